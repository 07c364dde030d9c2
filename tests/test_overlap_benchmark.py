"""benchmarks/overlap.py without running a federation: the plan of runs (hop-bound's more-steps side, secagg's
blocking side, a run reused rather than repeated), busy time from either source, the targets chosen from the
reference curves, time to target and its ratios (null, with a reason, when a side never gets there), the
accuracy gaps at equal rounds, the goal verdicts and the tables."""

from __future__ import annotations

import pytest
from rich.console import Console

from tests.conftest import REPO, load_script

overlap = load_script("nebula_benchmarks_overlap", REPO / "benchmarks" / "overlap.py")


def run(config, name, accs, *, link="unthrottled", seconds=10.0, start=5.0, busy=None, steps=10, train_s=None,
        reference=False, **side):
    """A run record: rounds 1..n with these accuracies, `seconds` per round (one value or one per round), `steps`
    per cluster-round (one value or one per round)."""
    seconds = seconds if isinstance(seconds, list) else [seconds] * len(accs)
    steps = steps if isinstance(steps, list) else [steps] * len(accs)
    rounds, elapsed = [], start
    for i, (acc, sec, n) in enumerate(zip(accs, seconds, steps, strict=True), start=1):
        elapsed += sec
        clusters = {cid: {"steps": n, "train_s": (train_s or [4.0, 8.0])[int(cid)],
                          "busy_fraction": busy, "busy_s": None, "idle_s": None, "busy_from": None}
                    for cid in ("0", "1")}
        rounds.append({"round": i, "accuracy": acc, "elapsed_s": elapsed, "seconds": sec, "clusters": clusters})
    side = {"config": config, "name": name, "link": link, "reference": reference, **side}
    return f"{config}/{name}@{link}", {"side": side, "rounds": rounds}


def test_quick_plans_only_what_the_figures_need_and_references_go_first():
    kw = dict(configs=overlap.CONFIGS, local_steps=10, hop_local_steps=2, rounds=4, secagg_rounds=3,
              hetero_workers="2,1", hetero_threads="2,1", secagg_clusters=3)
    quick = overlap.plan_sides(quick=True, **kw)
    assert [s.key for s in quick] == [
        "demo/blocking@wan", "demo/overlapped@wan", "hop-bound/blocking@wan", "hop-bound/overlapped-auto@wan",
        "hop-bound/blocking-more-steps@wan", "hetero/fixed@unthrottled", "hetero/budgeted@unthrottled",
        "secagg/blocking@unthrottled", "secagg/plain@unthrottled", "secagg/secure@unthrottled"]
    full = overlap.plan_sides(quick=False, **kw)
    assert len(full) == 15 and {s.key for s in quick} <= {s.key for s in full}
    for config in overlap.CONFIGS:  # a configuration's reference runs before any of its auto sides
        mine = [s for s in full if s.config == config]
        assert sum(s.reference for s in mine) == 1
        first_auto = next((i for i, s in enumerate(mine) if s.auto), len(mine))
        assert any(s.reference for s in mine[:first_auto]) or first_auto == len(mine)
    blocking, over = full[0], full[1]
    assert (blocking.local_steps, blocking.overlap, over.local_steps, over.overlap) == (10, False, 10, True)
    hop = {s.name: s for s in full if s.config == "hop-bound"}
    assert hop["blocking"].local_steps == hop["overlapped-auto"].local_steps == 2
    # the more-steps side: blocking, after overlapped-auto, whose median steps it takes; otherwise the same run
    more = hop["blocking-more-steps"]
    assert (more.overlap, more.auto, more.reference, more.local_steps) == (False, False, False, 0)
    assert more.steps_from == "hop-bound/overlapped-auto@wan" and more.link == "wan"
    assert [s.name for s in full if s.config == "hop-bound"] == ["blocking", "overlapped-auto", "blocking-more-steps"]
    assert (more.rounds, more.clusters, more.workers, more.slowdown) == (4, 2, None, None)
    sec = {s.name: s for s in full if s.config == "secagg"}
    assert [s.name for s in full if s.config == "secagg"] == ["blocking", "plain", "secure"]
    assert all(s.clusters == 3 and s.rounds == 3 and s.local_steps == 10 for s in sec.values())
    assert (sec["blocking"].overlap, sec["blocking"].secure, sec["blocking"].reference) == (False, False, True)
    assert sec["plain"].overlap and not sec["plain"].secure and sec["secure"].overlap and sec["secure"].secure


def test_more_steps_fixed_at_the_presets_is_the_demo_blocking_run_and_is_reused():
    kw = dict(configs=overlap.CONFIGS, local_steps=10, hop_local_steps=2, rounds=4, secagg_rounds=3,
              hetero_workers="2,1", hetero_threads="2,1", secagg_clusters=3)
    sides = {s.key: s for s in overlap.plan_sides(quick=True, hop_more_steps=10, **kw)}
    more = sides["hop-bound/blocking-more-steps@wan"]
    assert more.steps_from is None and more.local_steps == 10
    args = dict(preset="demo", seed=0, wan="20mbit:100ms", run_config="max-examples=800 eval-initial=false")
    demo_cmd = overlap.side_command(sides["demo/blocking@wan"], **args)
    assert overlap.side_command(more, **args) == demo_cmd
    runs = {"demo/blocking@wan": {"command": overlap.shlex.join(demo_cmd)}}
    assert overlap.same_run(overlap.side_command(more, **args), runs) == "demo/blocking@wan"
    # at the median the overlapped-auto side took (here 5), a run of its own
    assert overlap.same_run(overlap.side_command(overlap.replace(more, local_steps=5), **args), runs) is None
    assert overlap.same_run(overlap.side_command(sides["demo/overlapped@wan"], **args), runs) is None


def test_more_steps_are_the_overlapped_auto_median_over_rounds_two_on():
    # round 1 trains for the budget calibrated at 2 steps: left out
    _, auto = run("hop-bound", "overlapped-auto", [0.5, 0.6, 0.7, 0.8], steps=[2, 5, 6, 6])
    assert overlap.more_steps_of(auto["rounds"]) == 6
    auto["rounds"][3]["clusters"]["1"]["steps"] = 5  # 5 5 6 5 6 6: a median of 5.5 rounds up
    assert overlap.more_steps_of(auto["rounds"]) == 6
    auto["rounds"][2]["clusters"]["0"]["steps"] = 4  # 5 5 4 6 6 5: 5
    assert overlap.more_steps_of(auto["rounds"]) == 5
    _, one = run("hop-bound", "overlapped-auto", [0.5], steps=3)  # only a round 1: it counts
    assert overlap.more_steps_of(one["rounds"]) == 3
    _, none = run("hop-bound", "overlapped-auto", [0.5, 0.6], steps=None)
    assert overlap.more_steps_of(none["rounds"]) is None
    _, low = run("hop-bound", "overlapped-auto", [0.5, 0.6], steps=[0, 0])
    assert overlap.more_steps_of(low["rounds"]) == 1


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


def _all_runs(*, secure_seconds=11.0, auto_accs=(0.6, 0.85, 0.9), busy_over=0.95, secure_accs=(0.6, 0.8, 0.9)):
    wan = "wan"
    return dict([
        run("demo", "blocking", [0.6, 0.85, 0.9], link=wan, seconds=20.0, busy=0.5, reference=True),
        run("demo", "overlapped", [0.6, 0.84, 0.896], link=wan, seconds=14.0, busy=busy_over),
        run("demo", "overlapped-auto", list(auto_accs), link=wan, seconds=10.0, busy=1.0),
        run("hop-bound", "blocking", [0.5, 0.7, 0.8], link=wan, seconds=10.0, reference=True),
        run("hop-bound", "overlapped-auto", [0.5, 0.75, 0.8], link=wan, seconds=4.0, steps=[2, 5, 5]),
        run("hop-bound", "blocking-more-steps", [0.7, 0.8, 0.9], link=wan, seconds=12.0, steps=5, local_steps=5,
            steps_from=f"hop-bound/overlapped-auto@{wan}"),
        run("hetero", "fixed", [0.6, 0.8, 0.9], seconds=30.0, reference=True),
        run("hetero", "budgeted", [0.6, 0.8, 0.9], seconds=15.0),
        run("secagg", "blocking", [0.6, 0.82, 0.903], seconds=[30.0, 20.0, 20.0], reference=True),
        run("secagg", "plain", [0.6, 0.8, 0.91], seconds=[30.0, 10.0, 10.0]),
        run("secagg", "secure", list(secure_accs), seconds=[60.0, secure_seconds, secure_seconds]),
    ])


def test_figures_and_goals_from_synthetic_runs():
    runs = _all_runs()
    values, why = overlap.figures(runs, {"demo": 0.84, "hop-bound": 0.7, "hop-bound-more-steps": 0.75, "hetero": 0.8})
    # demo: blocking 5 + 20 + 20 = 45 s, overlapped 5 + 14 + 14 = 33 s
    assert values["time_to_target_ratio"] == pytest.approx(33 / 45)
    assert values["time_to_target_ratio_auto"] == pytest.approx(25 / 45)
    assert values["time_to_target_ratio_hop_bound"] == pytest.approx(13 / 25)  # round 2 both: 5+4+4 vs 5+10+10
    # against blocking at the 5 steps overlapped-auto took: 0.75 in round 2 both, 5+4+4 vs 5+12+12
    assert values["time_to_target_ratio_hop_bound_vs_more_steps"] == pytest.approx(13 / 29)
    assert values["hop_bound_vs_more_steps"] == {
        "blocking_more_steps_local_steps": 5, "steps_from": "hop-bound/overlapped-auto@wan", "reused_from": None,
        "overlapped_auto_median_steps": 5,
        "final_accuracy": {"blocking": 0.8, "overlapped_auto": 0.8, "blocking_more_steps": 0.9},
        "time_to_target_s": {"overlapped_auto": 13.0, "blocking_more_steps": 29.0}}
    assert values["accuracy_gap_points"] == pytest.approx(0.4)
    assert values["busy_fraction"] == {"blocking": 0.5, "overlapped": 0.95, "overlapped_auto": 1.0}
    assert values["hetero_time_ratio"] == pytest.approx(35 / 65)
    assert values["secure_over_plain_overlapped"] == pytest.approx(1.1)  # rounds 2..3 only: round 1 is the setup
    assert values["secure_overlapped_over_blocking"] == pytest.approx(11 / 20)
    assert values["secagg_final_accuracy"] == {"blocking": 0.903, "plain": 0.91, "secure": 0.9}
    assert values["secure_overlapped_accuracy_gap_points"] == pytest.approx(0.3)  # 3 rounds each
    assert values["plain_overlapped_accuracy_gap_points"] == pytest.approx(-0.7)  # plain ended higher
    assert values["time_to_target_ratio_unthrottled"] is None and "did not run" in why["time_to_target_ratio_unthrottled"]
    assert values["hetero_time_ratio_overlapped"] is None
    goals = overlap.judge(values)
    assert {k: g["met"] for k, g in goals.items()} == {
        "time_to_target_ratio": True, "time_to_target_ratio_hop_bound": False, "accuracy_gap_points": True,
        "busy_fraction": True, "hetero_time_ratio": True, "secure_over_plain_overlapped": True,
        "secure_overlapped_accuracy_gap_points": True}
    assert goals["secure_overlapped_accuracy_gap_points"]["goal"] == "<= 0.5"
    assert not set(overlap.UNJUDGED) & set(goals)  # beside the goals, not judged
    assert goals["busy_fraction"]["value"] == 0.95 and goals["busy_fraction"]["goal"] == ">= 0.9 (overlapped)"


def test_a_side_that_never_reaches_the_target_gives_null_not_a_number():
    runs = _all_runs(secure_seconds=12.0, busy_over=None, secure_accs=(0.5, 0.7, 0.89))
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
    assert values["secure_overlapped_accuracy_gap_points"] == pytest.approx(1.3)  # 0.903 - 0.89: over 0.5
    assert not goals["secure_overlapped_accuracy_gap_points"]["met"]
    assert values["time_to_target_ratio_hop_bound_vs_more_steps"] is None
    assert "no target for hop-bound-more-steps" in why["time_to_target_ratio_hop_bound_vs_more_steps"]


def test_overlapped_auto_short_of_blocking_more_steps_gives_null_with_the_reason():
    runs = _all_runs()
    # the target from blocking-more-steps: its final 0.9, above both round 1s (0.7, 0.5); overlapped-auto ends at 0.8
    sides = overlap.plan_sides(quick=True, configs=("hop-bound",), local_steps=10, hop_local_steps=2, rounds=3,
                               secagg_rounds=3, hetero_workers="2,1", hetero_threads=None, secagg_clusters=3)
    targets = overlap.pick_targets(sides, runs, {})
    assert targets["hop-bound-more-steps"]["value"] == 0.9
    values, why = overlap.figures(runs, {c: t["value"] for c, t in targets.items()})
    assert values["time_to_target_ratio_hop_bound_vs_more_steps"] is None
    assert why["time_to_target_ratio_hop_bound_vs_more_steps"] == (
        "hop-bound/overlapped-auto@wan never reached accuracy 0.9000 in 3 rounds")
    assert values["hop_bound_vs_more_steps"]["time_to_target_s"] == {"overlapped_auto": None,
                                                                   "blocking_more_steps": 29.0 + 12.0}
    assert values["time_to_target_ratio_hop_bound"] == pytest.approx(17 / 35)  # its own target (0.8) unmoved
    # the more-steps side did not run (no steps from overlapped-auto): null, and why
    del runs["hop-bound/blocking-more-steps@wan"]
    values, why = overlap.figures(runs, {"hop-bound": 0.8, "hop-bound-more-steps": None})
    assert values["time_to_target_ratio_hop_bound_vs_more_steps"] is None
    assert why["time_to_target_ratio_hop_bound_vs_more_steps"] == "hop-bound/blocking-more-steps@wan did not run"
    assert values["hop_bound_vs_more_steps"]["blocking_more_steps_local_steps"] is None


def test_secagg_gaps_need_the_blocking_side_and_equal_rounds():
    runs = _all_runs()
    del runs["secagg/blocking@unthrottled"]
    values, why = overlap.figures(runs, {})
    for key in ("secure_overlapped_accuracy_gap_points", "plain_overlapped_accuracy_gap_points",
                "secure_overlapped_over_blocking"):
        assert values[key] is None
    assert why["secure_overlapped_accuracy_gap_points"] == "secagg/blocking@unthrottled did not run"
    assert "blocking or secure did not run" in why["secure_overlapped_over_blocking"]
    assert values["secure_over_plain_overlapped"] == pytest.approx(1.1)  # the pair's own figure stands
    assert not overlap.judge(values)["secure_overlapped_accuracy_gap_points"]["met"]
    runs = _all_runs()
    runs["secagg/secure@unthrottled"]["rounds"].pop()  # a secure run one round short: not compared
    values, why = overlap.figures(runs, {})
    assert values["secure_overlapped_accuracy_gap_points"] is None
    assert why["secure_overlapped_accuracy_gap_points"] == (
        "unequal rounds: secagg/blocking@unthrottled 3, secagg/secure@unthrottled 2")
    assert values["plain_overlapped_accuracy_gap_points"] == pytest.approx(-0.7)
    runs["secagg/plain@unthrottled"]["rounds"][-1]["accuracy"] = None
    values, why = overlap.figures(runs, {})
    assert why["plain_overlapped_accuracy_gap_points"] == "secagg/plain@unthrottled has no final accuracy"

def test_calibration_and_per_step_times():
    _, r = run("hetero", "fixed", [0.5, 0.6, 0.7], train_s=[4.0, 16.0], steps=8)
    assert overlap.slowest_train_s(r["rounds"]) == 16.0  # the slow cluster's: the fast one trains through its wait
    r["rounds"][0]["clusters"]["1"]["train_s"] = 30.0  # round 1 (warm-up) only counts when it is the only one
    assert overlap.slowest_train_s(r["rounds"]) == 16.0 and overlap.slowest_train_s(r["rounds"][:1]) == 30.0
    assert overlap.seconds_per_step(r["rounds"]) == {"0": 0.5, "1": 2.0}
    assert overlap.median_round_s(r["rounds"]) == 10.0 and overlap.median_steps(r["rounds"]) == 8


def test_tables_show_every_figure_and_say_why_one_is_missing():
    runs = _all_runs()
    runs["hop-bound/blocking-more-steps@wan"]["reused_from"] = "demo/blocking@wan"  # as if its steps were 10
    targets = {"demo": 0.899, "hop-bound": 0.7, "hop-bound-more-steps": 0.85, "hetero": 0.8}
    values, why = overlap.figures(runs, targets)
    chosen = {c: {"value": v, "how": "fixed by --target", "reference": f"{c}/blocking@wan"} for c, v in targets.items()}
    chosen["hop-bound-more-steps"]["reference"] = "hop-bound/blocking-more-steps@wan"
    per_run = {}
    for key, r in runs.items():
        name = overlap.target_name(key, r["side"], chosen)
        per_run[key] = {"side": r["side"], "rounds": len(r["rounds"]), "command_seconds": 60.0, "target": name,
                        "reused_from": r.get("reused_from"), **overlap.run_summary(r, targets.get(name))}
    assert per_run["hop-bound/blocking-more-steps@wan"]["target"] == "hop-bound-more-steps"
    assert per_run["hop-bound/blocking-more-steps@wan"]["round_reached"] == 3  # 0.85: its own target, not 0.7
    assert per_run["hop-bound/overlapped-auto@wan"]["target"] == "hop-bound"
    results = {**values, "why_null": why, "goals": overlap.judge(values), "runs": per_run, "targets": chosen,
               "settings": {"wan": "20mbit:100ms"}}
    console = Console(record=True, width=400)
    console.print(overlap.runs_table(results))
    console.print(overlap.goals_table(results))
    text = console.export_text()
    for key in (*overlap.GOALS, *overlap.UNJUDGED):
        assert key in text
    assert "never reached accuracy 0.8990" in text and "NO" in text
    assert "not in 3" in text and "blocking (ref)" in text and "20mbit:100ms" in text
    assert "blocking-more-steps (5 steps) (= demo/blocking@wan)" in text
    assert "blocking at 5 steps (= demo/blocking@wan); final accuracy overlapped-auto 0.8000, blocking-more-steps " \
           "0.9000, blocking 0.8000" in text
    assert "final accuracy blocking 0.9030, plain 0.9100, secure 0.9000" in text
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
    results = {"targets": {"hop-bound": {"value": 0.8, "reference": "hop-bound/blocking@wan"},
                           "hop-bound-more-steps": {"value": 0.9, "reference": "hop-bound/blocking-more-steps@wan"}}}
    overlap.plot(runs, results, tmp_path / "t.png", wan="20mbit:100ms")  # two targets on the hop-bound panel
    assert (tmp_path / "t.png").stat().st_size > 10_000


def test_targets_per_configuration_chosen_fixed_or_missing():
    sides = overlap.plan_sides(quick=True, configs=("demo", "hop-bound", "hetero", "secagg"), local_steps=10,
                               hop_local_steps=2, rounds=3, secagg_rounds=3, hetero_workers="2,1", hetero_threads="2,1",
                               secagg_clusters=3)
    runs = _all_runs()
    del runs["hetero/fixed@unthrottled"]
    targets = overlap.pick_targets(sides, runs, {"hop-bound": 0.45})
    assert set(targets) == {"demo", "hop-bound", "hop-bound-more-steps", "hetero"}
    assert targets["demo"]["value"] == 0.9 and targets["demo"]["reached_in_round_1"] == []  # blocking's final
    assert targets["hop-bound"] == {"value": 0.45, "how": "fixed by --target", "reference": "hop-bound/blocking@wan",
                                    "reached_in_round_1": ["hop-bound/blocking@wan", "hop-bound/overlapped-auto@wan"]}
    assert targets["hetero"]["value"] is None and "did not run" in targets["hetero"]["how"]
    more = targets["hop-bound-more-steps"]  # from blocking-more-steps: its final, above both round 1s (0.7, 0.5)
    assert (more["value"], more["reference"], more["reached_in_round_1"]) == (
        0.9, "hop-bound/blocking-more-steps@wan", [])
    assert "hop-bound/blocking-more-steps@wan, hop-bound/overlapped-auto@wan" in more["how"]
    # the more-steps side's round 1 does not move hop-bound's own target: it is left out of that comparison
    runs["hop-bound/blocking-more-steps@wan"]["rounds"][0]["accuracy"] = 0.85
    targets = overlap.pick_targets(sides, runs, {})
    assert targets["hop-bound"]["value"] == 0.8  # blocking's final, though the more-steps side had 0.85 in round 1
    assert targets["hop-bound-more-steps"]["value"] == 0.9
    assert targets["hop-bound-more-steps"]["reached_in_round_1"] == []
    runs["hop-bound/blocking-more-steps@wan"]["rounds"][0]["accuracy"] = 0.95  # above its own final: the lowest above
    assert overlap.pick_targets(sides, runs, {})["hop-bound-more-steps"]["value"] is None
    assert overlap.pick_targets(sides, {}, {})["hop-bound-more-steps"]["how"] == (
        "none: hop-bound/blocking-more-steps@wan did not run")
    groups = overlap.target_groups(sides)
    assert "secagg" not in groups and groups["hop-bound"] == (
        "hop-bound/blocking@wan", ["hop-bound/blocking@wan", "hop-bound/overlapped-auto@wan"])


def test_box_cpu_busy_is_the_share_of_cpu_time_not_idle():
    bench = overlap
    before = [100, 0, 50, 800, 50, 0, 0, 0, 0, 0]
    after = [400, 0, 150, 1000, 50, 0, 0, 0, 0, 0]  # 400 busy, 200 idle of 600
    assert bench.cpu_busy(before, after) == pytest.approx(400 / 600)
    assert bench.cpu_busy(None, after) is None and bench.cpu_busy(before, before) is None


@pytest.mark.parametrize("auto_steps, launched", [(10, 9), (5, 10)])
def test_the_quick_plan_runs_with_the_more_steps_side_reused_when_its_command_repeats(tmp_path, monkeypatch,
                                                                                        auto_steps, launched):
    """main() with a stand-in for the federations: the more-steps side takes overlapped-auto's median steps (rounds
    >= 2) and, at the demo's 10, is the demo's blocking run at --wan, reused rather than run again."""
    commands = []

    def fake_run(cmd, *, folder, log):
        commands.append(cmd)
        steps = cmd[cmd.index("--local-steps") + 1]
        clusters = int(cmd[cmd.index("--clusters") + 1])
        lines = []
        for rnd in range(1, int(cmd[cmd.index("--rounds") + 1]) + 1):
            n = (2 if rnd == 1 else auto_steps) if steps == "auto" else int(steps)
            lines.append({"round": rnd, "accuracy": 0.5 + 0.1 * rnd, "elapsed_seconds": 10.0 * rnd,
                          "aggregated_seconds": 10.0 * rnd - 1, "seconds": 10.0,
                          "clusters": {str(c): {"steps": n, "seconds": 1.0} for c in range(clusters)}})
        return {}, lines

    monkeypatch.setattr(overlap, "run_federation", fake_run)
    out = tmp_path / "out"
    monkeypatch.setattr(overlap.sys, "argv", ["overlap.py", "--quick", "--out", str(out)])
    assert overlap.main() == 0
    assert len(commands) == launched
    results = overlap.json.loads((out / "results.json").read_text())
    more = results["runs"]["hop-bound/blocking-more-steps@wan"]
    assert more["side"]["local_steps"] == auto_steps and more["side"]["steps_from"] == "hop-bound/overlapped-auto@wan"
    assert list(results["runs"]) == [
        "demo/blocking@wan", "demo/overlapped@wan", "hop-bound/blocking@wan", "hop-bound/overlapped-auto@wan",
        "hop-bound/blocking-more-steps@wan", "hetero/fixed@unthrottled", "hetero/budgeted@unthrottled",
        "secagg/blocking@unthrottled", "secagg/plain@unthrottled", "secagg/secure@unthrottled"]
    reused = {"hop-bound/blocking-more-steps@wan": "demo/blocking@wan"} if auto_steps == 10 else {}
    assert results["reused"] == reused and more["reused_from"] == reused.get("hop-bound/blocking-more-steps@wan")
    assert results["hop_bound_vs_more_steps"]["reused_from"] == more["reused_from"]
    assert any("reused" in note for note in results["notes"]) == bool(reused)
    assert results["targets"]["hop-bound-more-steps"]["reference"] == "hop-bound/blocking-more-steps@wan"
    # the same curve everywhere here: every side reaches the more-steps target in the same round, a ratio of 1
    assert results["time_to_target_ratio_hop_bound_vs_more_steps"] == pytest.approx(1.0)
    assert results["secure_overlapped_accuracy_gap_points"] == pytest.approx(0.0)
    assert set(results["goals"]) == set(overlap.GOALS)
    blocking = [c for c in commands if c[c.index("--clusters") + 1] == "3" and "--round-overlap" not in c]
    assert len(blocking) == 1 and "--secure-aggregation" not in blocking[0]
