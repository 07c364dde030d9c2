"""A round's timeline: the pure arithmetic, the proxy's wire clock, and evaluation overlapping the next round."""

import random
import threading
import time

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord

from nebula_fl.config import OuterConfig
from nebula_fl.server.timeline import cluster_phases, round_timeline, utilisation_note
from nebula_fl.strategies import make_strategy
from nebula_fl.strategies.adapter_strategy import to_numpy
from nebula_fl.wan.proxy import _WireClock
from tests.test_round_faults import GLOBAL, ScriptedGrid


def test_cluster_phases_come_from_the_two_clocks_and_leave_out_what_is_unknown():
    metrics = {"received-at": 102.5, "reply-sent-at": 110.0, "client-seconds": 7.5, "seconds": 6.0,
               "encode-seconds": 0.25, "task-started-at": 101.5}
    phases = cluster_phases(pushed_at=100.0, arrived_at=111.25, metrics=metrics, wire_s=0.75)
    assert phases == {"pickup_s": 2.5, "wait_s": 1.5, "start_s": 1.0, "compute_s": 7.5, "train_s": 6.0,
                      "encode_s": 0.25, "upload_s": 1.25, "transfer_s": 0.75}
    # a process start outside [push, received] (clocks of two machines) is not split off the pickup
    assert "start_s" not in cluster_phases(pushed_at=100.0, arrived_at=None, wire_s=None,
                                           metrics={"received-at": 102.5, "task-started-at": 99.0})
    assert cluster_phases(pushed_at=100.0, arrived_at=None, metrics={}, wire_s=None) == {}


def test_overhead_is_the_round_less_the_slowest_clusters_compute_and_transfer_and_the_evaluation():
    clusters = {"0": {"compute_s": 6.0, "transfer_s": 3.0}, "1": {"compute_s": 8.0}, "2": {"pickup_s": 1.0}}
    t = round_timeline(seconds=20.0, phases={"evaluate_s": 4.0, "aggregate_s": 0.5}, clusters=clusters)
    assert t["slowest_cluster"] == "0"  # 6 + 3 > 8: the link counts
    assert t["overhead_s"] == pytest.approx(20.0 - 9.0 - 4.0)
    assert t["clusters"]["2"] == {"pickup_s": 1.0} and t["round_s"] == 20.0
    # no cluster answered: the whole round less evaluation is overhead, never negative
    assert round_timeline(seconds=5.0, phases={}, clusters={})["overhead_s"] == 5.0
    assert round_timeline(seconds=1.0, phases={"evaluate_s": 3.0}, clusters={})["overhead_s"] == 0.0


def test_the_wire_clock_is_the_length_of_the_union_of_busy_intervals():
    rng = random.Random(7)
    clock, intervals, start = _WireClock(), [], 0.0
    for _ in range(500):  # handed to the link in time order, delivered after a delay, overlapping
        start += rng.expovariate(4.0)
        end = start + rng.uniform(0.0, 0.6)
        intervals.append((start, end))
        clock.add(start, end)
    merged: list[list[float]] = []  # the textbook merge of sorted intervals, as an independent reference
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    assert clock.seconds == pytest.approx(sum(b - a for a, b in merged), rel=1e-12)


def _overlapped_run(grid, rounds, evaluate_s):
    strategy = make_strategy(OuterConfig())
    outcomes, during = [], []
    busy = threading.Event()

    def evaluate(rnd, arrays):
        busy.set()
        time.sleep(evaluate_s)
        busy.clear()
        return MetricRecord({"accuracy": float(to_numpy(arrays)["w"][0])})

    def pushes(messages):  # what the next round's push saw: was an evaluation running?
        during.append(busy.is_set())
        return ScriptedGrid.push_messages(grid, messages)

    grid.push_messages = pushes
    started = time.monotonic()
    strategy.start(grid, ArrayRecord({"w": Array(GLOBAL["w"])}), num_rounds=rounds, timeout=60.0,
                   train_config=ConfigRecord({}), evaluate_fn=evaluate, evaluate_initial=False,
                   on_round_end=outcomes.append, poll_interval=0.01, overlap_evaluation=True)
    return outcomes, during, time.monotonic() - started


def test_evaluation_overlaps_the_next_round_and_every_round_still_ends_in_order_with_its_own_state():
    outcomes, during, wall = _overlapped_run(ScriptedGrid({1: "0", 2: "1"}), rounds=3, evaluate_s=0.4)
    assert [o.round for o in outcomes] == [1, 2, 3]
    assert any(during[1:]), "no later round was pushed while an evaluation ran"
    # each round's adapter moved by one (every node sends ones): its evaluation saw its own adapter
    assert [o.eval_metrics["accuracy"] for o in outcomes] == [1.0, 2.0, 3.0]
    assert [to_numpy(o.arrays)["w"][0] for o in outcomes] == [1.0, 2.0, 3.0]
    assert all(o.phases["evaluate_s"] >= 0.4 and o.seconds >= o.phases["evaluate_s"] for o in outcomes)
    assert all(o.strategy_state is not None for o in outcomes)
    assert wall < 3 * 0.4 + 1.5  # the last evaluation is waited for, the earlier ones hid behind rounds


def test_a_failed_overlapped_evaluation_ends_the_run_with_its_error():
    strategy = make_strategy(OuterConfig())

    def evaluate(rnd, arrays):
        raise RuntimeError(f"the evaluation of round {rnd} broke")

    from nebula_fl.strategies.base import RoundFinishFailed

    with pytest.raises(RoundFinishFailed, match=r"round 1's evaluation failed: RuntimeError: .*round 1 broke"):
        strategy.start(ScriptedGrid({1: "0"}), ArrayRecord({"w": Array(np.zeros(3, np.float32))}), num_rounds=4,
                       timeout=60.0, train_config=ConfigRecord({}), evaluate_fn=evaluate, evaluate_initial=False,
                       on_round_end=lambda o: None, poll_interval=0.01, overlap_evaluation=True)


def test_a_resume_restores_the_record_of_a_round_checkpointed_just_before_a_crash(tmp_path):
    from nebula_fl.config import RunConfig
    from nebula_fl.server.app import ServerRun
    from nebula_fl.storage.run_folder import RunFolder

    cfg = RunConfig.from_flat({"out-dir": str(tmp_path / "run"), "resume": True})
    folder = RunFolder(tmp_path / "run")
    folder.path.mkdir()
    folder.write_config({"run_config": cfg.to_flat(), "federation_id": "fed1"})
    line = {"round": 2, "accuracy": 0.5, "clusters": {}}
    folder.append_round({"round": 1, "accuracy": 0.25, "clusters": {}})
    folder.save_checkpoint(round=2, adapter={"w": np.zeros(2, np.float32)},
                           state={"strategy": {}, "wall_seconds": 3.0, "line": line})
    first, _, _ = ServerRun(cfg)._open()
    assert first == 3
    assert [r["round"] for r in folder.rounds()] == [1, 2] and folder.rounds()[1]["accuracy"] == 0.5


def test_the_launcher_makes_flowers_superexec_poll_every_tenth_of_a_second_unless_told_otherwise(tmp_path, monkeypatch):
    from nebula_fl.launcher.federation import child_env

    monkeypatch.delenv("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", raising=False)
    assert child_env(tmp_path)["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"] == "0.1"
    monkeypatch.setenv("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", "0.5")
    assert child_env(tmp_path)["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"] == "0.5"


def test_busy_fraction_and_idle_time_come_from_the_clusters_busy_and_since_send_seconds():
    # 6 s of training in the 8 s since its previous send: 75 % busy, 2 s idle
    assert cluster_phases(pushed_at=None, arrived_at=None, wire_s=None,
                          metrics={"busy-seconds": 6.0, "since-send-seconds": 8.0}) == {"busy_fraction": 0.75,
                                                                                        "idle_s": 2.0}
    # busy past the interval (two clocks in the cluster): clamped to fully busy, never negative idle
    assert cluster_phases(pushed_at=None, arrived_at=None, wire_s=None,
                          metrics={"busy-seconds": 8.5, "since-send-seconds": 8.0}) == {"busy_fraction": 1.0,
                                                                                        "idle_s": 0.0}
    # a cluster's first round (no since-send-seconds), or a zero interval: nothing said
    for metrics in ({"busy-seconds": 6.0}, {"since-send-seconds": 8.0}, {"busy-seconds": 0.0, "since-send-seconds": 0}):
        assert cluster_phases(pushed_at=None, arrived_at=None, wire_s=None, metrics=metrics) == {}


def test_the_round_keeps_the_least_busy_fraction_and_the_longest_idle_time():
    clusters = {"0": {"compute_s": 6.0, "busy_fraction": 0.9, "idle_s": 1.0},
                "1": {"compute_s": 8.0, "busy_fraction": 0.5, "idle_s": 0.5},  # 1 s busy of 1.5 s: idle 0.5 s
                "2": {"compute_s": 1.0}}  # its first round: not counted
    t = round_timeline(seconds=20.0, phases={}, clusters=clusters)
    assert t["busy_fraction_min"] == 0.5 and t["idle_s_max"] == 1.0
    assert utilisation_note(t) == "busy min 50%, idle max 1.0 s"
    bare = round_timeline(seconds=20.0, phases={}, clusters={"2": {"compute_s": 1.0}})
    assert "busy_fraction_min" not in bare and "idle_s_max" not in bare
    assert utilisation_note(bare) == "busy n/a"


def test_a_recorded_round_shows_utilisation_in_its_record_its_console_line_and_tensorboard(tmp_path, monkeypatch):
    from nebula_fl.config import RunConfig
    from nebula_fl.server import app
    from nebula_fl.strategies.base import NodeTraffic, RoundOutcome
    from tests.test_tensorboard import read_back

    lines = []
    monkeypatch.setattr(app, "log", lambda level, msg, *args: lines.append(msg % args))
    run = app.ServerRun(RunConfig.from_flat({"out-dir": str(tmp_path / "run")}))
    run._open()
    run.metric, run.strategy = "accuracy", make_strategy(OuterConfig())
    nodes = {11: NodeTraffic(metrics={"cluster-id": 0, "busy-seconds": 3.0, "since-send-seconds": 4.0}),
             12: NodeTraffic(metrics={"cluster-id": 1, "busy-seconds": 9.0, "since-send-seconds": 10.0}),
             13: NodeTraffic(metrics={"cluster-id": 2})}  # its first round
    normalized = MetricRecord({"clusters": 3, "steps-normalized": 1, "tau-eff": 6.5})
    run._record_round(RoundOutcome(round=1, arrays=ArrayRecord({"w": Array(GLOBAL["w"])}), train_metrics=normalized,
                                   eval_metrics=MetricRecord({"accuracy": 0.5, "loss": 1.0}), nodes=nodes,
                                   rejected={}, seconds=12.0))
    run.tensorboard.close()
    record = run.folder.rounds()[-1]
    assert record["steps_normalized"] is True and record["tau_eff"] == 6.5  # FedNova said so in the record
    timeline = record["timeline"]
    assert timeline["clusters"]["0"] == {"busy_fraction": 0.75, "idle_s": 1.0}
    assert timeline["clusters"]["1"] == {"busy_fraction": 0.9, "idle_s": 1.0}
    assert timeline["clusters"]["2"] == {}
    assert timeline["busy_fraction_min"] == 0.75 and timeline["idle_s_max"] == 1.0
    assert lines[-1].startswith("round 1: accuracy 0.5000") and lines[-1].endswith(", busy min 75%, idle max 1.0 s")
    got = read_back(run.folder.path / "tensorboard")
    assert got["timeline/cluster_0/busy_fraction"] == {1: 0.75} and got["timeline/cluster_1/idle_s"] == {1: 1.0}
    assert got["timeline/busy_fraction_min"] == {1: 0.75} and got["timeline/idle_s_max"] == {1: 1.0}


def test_the_run_table_shows_the_least_busy_cluster_of_each_round_when_the_clusters_timed_it():
    from rich.console import Console

    from nebula_fl.launcher.report import results_table

    def render(rounds):
        console = Console(width=200, record=True)
        console.print(results_table(rounds))
        return console.export_text()

    timed = [{"round": 1, "accuracy": 0.5, "clusters": {}, "timeline": {}},
             {"round": 2, "accuracy": 0.6, "clusters": {}, "timeline": {"busy_fraction_min": 0.934}}]
    text = render(timed)
    assert "busy (min)" in text and "93%" in text
    assert "busy (min)" not in render([{"round": 1, "accuracy": 0.5, "clusters": {}, "timeline": {}}])
