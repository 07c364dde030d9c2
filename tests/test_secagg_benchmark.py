"""benchmarks/secagg.py without running a federation: nebula-fl's polling read from its code, the per-side
polling report (equal sides pass, any difference is a note), the results keep their keys with the demo
pair beside the 8-cluster figures, and the overlapped pair: its figure over rounds 2..R, the check that each
side ran as labelled (overlapped or blocking) and the secure sides' trips per round."""

from __future__ import annotations

import argparse
import inspect
import json

import numpy as np
import pytest

from nebula_fl.launcher.federation import SUPEREXEC_POLL_S
from nebula_fl.strategies.base import NebulaStrategy
from tests.conftest import REPO, load_script

secagg = load_script("nebula_benchmarks_secagg", REPO / "benchmarks" / "secagg.py")
WATCHED = {"supernode": ["0.1"], "superlink": ["0.1"]}


def test_polling_is_read_from_nebula_fl(monkeypatch):
    monkeypatch.delenv("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", raising=False)
    polling = secagg.nebula_polling()
    assert polling["server_pull_s"] == inspect.signature(NebulaStrategy.start).parameters["poll_interval"].default
    assert polling["superexec_task_poll_s"] == SUPEREXEC_POLL_S
    monkeypatch.setenv("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", "0.7")  # the launcher keeps a value already set
    assert secagg.nebula_polling()["superexec_task_poll_s"] == "0.7"


def test_keyword_values(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("s.start(g, poll_interval=0.5)\nexchange(poll_interval=self.p)\nexchange(x)\n")
    assert secagg._keyword_values(source, "poll_interval", call="start") == [0.5]
    assert secagg._keyword_values(source, "poll_interval", call="exchange") == ["self.p"]
    assert secagg._keyword_values(source, "poll_interval", call="other") is None


def _secagg_report(i, rounds, overlap):
    """A secure round's `secagg` report as the strategy writes it: blocking, every round unmasked at once (one
    extra trip); overlapped, round 1 held (`pending`), round r applying round r-1's sum with no extra trip, the
    last round flushing its own with one."""
    report = {"setup_trips": 2, "setup_s": 2.0, "extra_trips": 0 if overlap else 1} if i == 0 else \
        {"extra_trips": 0 if overlap and i < rounds - 1 else 1, "unmask_s": 0.5}
    if not overlap:
        return {**report, "unmask_s": 0.5, "unmasked_round": i + 1, "survivors": 2}
    if i == 0:
        return {**report, "unmasked_round": None, "unmasked_rounds": [], "pending": 1, "uploaded": 2}
    return {**report, "unmasked_round": i + 1 if i == rounds - 1 else i, "survivors": 2,
            "unmasked_rounds": [i, i + 1] if i == rounds - 1 else [i]}


def _nebula(secure=False, rounds=3, clusters=2, seconds=(10.0, 8.0, 9.0), up=100, overlap=False):
    """A side as run_nebula returns it. Plain clusters report their timings (`busy_seconds` counts the steps
    trained ahead: above `seconds` from round 2 when overlapped); secure ones do not."""
    def cluster(i):
        timing = {} if secure else {"seconds": 0.01 if overlap and i else 0.2, "busy_seconds": 0.2}
        return {"bytes_up": up, "bytes_down": 50, **timing}

    rows = [{"round": i + 1, "seconds": s, "accuracy": 0.5, "skipped": None,
             "clusters_aggregated": 0 if secure and overlap and i == 0 else clusters,
             "secagg": _secagg_report(i, rounds, overlap) if secure else None,
             "clusters": {str(c): cluster(i) for c in range(clusters)}}
            for i, s in enumerate(seconds[:rounds])]
    return {"name": "x", "secure": secure, "folder": "f", "params": 1000, "round_overlap": overlap,
            "round_seconds": list(seconds[:rounds]), "rounds": rows, "wall_s": 60.0, "superexec_task_poll_s": WATCHED}


def _legacy(poll_s=0.2, measured=0.21, task="0.1"):
    return {"round_seconds": [30.0, 20.0, 22.0], "median_round_s": 22.0, "bytes_up_per_client": 1,
            "bytes_down_per_client": 1, "num_shares": 8, "threshold": 5, "max_abs_error": 1e-5, "workdir": "w",
            "poll_s": poll_s, "pulls": 100, "pull_interval_s": measured,
            "superexec_task_poll_s": {"supernode": [task], "superlink": [task]}}


NEBULA = {"server_pull_s": 0.2, "stage_pull_s": [0.2], "superexec_task_poll_s": "0.1", "source": ""}


def test_polling_report_equal_and_unequal():
    sides = {"nebula_plain": _nebula(), "nebula_secure": _nebula(secure=True), "legacy_secure": _legacy(),
             "legacy_plain": None, "demo_nebula_plain": _nebula(), "demo_nebula_secure": _nebula(secure=True)}
    report, notes = secagg.polling_report(NEBULA, sides)
    assert notes == [] and set(report) == {k for k, v in sides.items() if v is not None}
    assert report["demo_nebula_secure"]["stage_pull_s"] == [0.2] and "pulls" not in report["demo_nebula_plain"]
    assert report["legacy_secure"]["measured_pull_interval_s"] == 0.21
    assert report["nebula_secure"]["stage_pull_s"] == [0.2]
    # Flower's own 3 s pulls, a pull loop that does not keep its interval, another SuperExec poll: each a note
    for legacy in (_legacy(poll_s=3.0), _legacy(measured=0.9), _legacy(task="1.0")):
        _, notes = secagg.polling_report(NEBULA, {**sides, "legacy_secure": legacy})
        assert len(notes) == 1 and "legacy_secure" in notes[0]


def test_results_keep_their_keys_and_add_the_demo():
    args = argparse.Namespace(clusters=8, rounds=3, lora_r=108, max_examples=240, max_seq_len=32, test_fraction=0.1,
                              seed=0, quick=True, demo_rounds=3)
    plain, secure = _nebula(clusters=8), _nebula(secure=True, clusters=8, seconds=(20.0, 10.0, 11.0), up=101)
    demo = secagg.demo_pair(_nebula(seconds=(30.0, 20.0, 30.0)), _nebula(secure=True, seconds=(40.0, 22.0, 33.0)),
                            quick=True)
    res = secagg.analyse(plain, secure, _legacy(), None, demo=demo, polling={"equal": True}, args=args,
                         command="c", notes=[])
    for key in ("secure_over_plain", "legacy_over_nebula", "bytes_secure_over_plain", "clusters", "params"):
        assert key in res
    assert res["secure_over_plain"] == (10.5 / 8.5)
    assert res["legacy_over_nebula"] == 21.0 / 10.5
    assert res["secure_over_plain_demo"] == 27.5 / 25.0  # medians of rounds 2..3
    assert demo["stage_seconds"]["setup_s"] == 2.0 and demo["rounds"] == 3 and demo["clusters"] == 2
    assert res["goals"]["secure_over_plain_demo"] == {"value": 1.1, "goal": "<= 1.3", "met": True}


def test_the_overlapped_pair_differs_only_by_round_overlap():
    args = argparse.Namespace(clusters=8, rounds=3, seed=0, max_examples=240, max_seq_len=32, lora_r=108,
                              test_fraction=0.1)
    for secure in (False, True):
        blocking, overlapped = secagg.nebula_args(args, secure=secure), secagg.nebula_args(args, secure=secure, overlap=True)
        assert overlapped == [*blocking, "--round-overlap"]


def test_overlapped_figure_is_the_ratio_of_rounds_2_to_R():
    plain = _nebula(clusters=8, overlap=True, seconds=(12.0, 6.0, 8.0, 7.0), rounds=4)
    secure = _nebula(secure=True, clusters=8, overlap=True, seconds=(30.0, 6.5, 9.5, 8.0), rounds=4, up=110)
    pair = secagg.overlapped_pair(plain, secure)
    assert pair["secure_over_plain"] == 8.0 / 7.0  # medians of (6.5, 9.5, 8.0) and (6.0, 8.0, 7.0): round 1 left out
    assert pair["steady_secure_over_plain"] == 8.0 / 7.0  # rounds 2..3 (no last-round flush): 8.0 / 7.0 as well
    assert pair["bytes_secure_over_plain"] == 160 / 150
    assert pair["compared_rounds"] == "2..4"
    # three rounds: the median of rounds 2..3 is their mean; without the flush, round 2 alone
    three = secagg.overlapped_pair(_nebula(overlap=True, seconds=(12.0, 6.0, 8.0)),
                                   _nebula(secure=True, overlap=True, seconds=(30.0, 6.0, 10.0)))
    assert three["secure_over_plain"] == 8.0 / 7.0 and three["steady_secure_over_plain"] == 1.0
    assert secagg.overlapped_pair(_nebula(overlap=True, rounds=2), _nebula(secure=True, overlap=True, rounds=2)
                                  )["steady_secure_over_plain"] is None
    assert [(t["setup_trips"], t["extra_trips"], t["applied"], t["pending"]) for t in pair["trips"]] == [
        (2, 0, [], 1), (0, 0, [1], None), (0, 0, [2], None), (0, 1, [3, 4], None)]


def test_analyse_adds_the_overlapped_goal_and_every_secure_sides_trips():
    args = argparse.Namespace(clusters=8, rounds=3, lora_r=108, max_examples=240, max_seq_len=32, test_fraction=0.1,
                              seed=0, quick=True, demo_rounds=3)
    plain, secure = _nebula(clusters=8), _nebula(secure=True, clusters=8, seconds=(20.0, 10.0, 11.0))
    pair = secagg.overlapped_pair(_nebula(clusters=8, overlap=True, seconds=(10.0, 5.0, 5.0)),
                                  _nebula(secure=True, clusters=8, overlap=True, seconds=(20.0, 5.0, 6.2)))
    res = secagg.analyse(plain, secure, None, None, demo=None, polling={"equal": True}, args=args, command="c",
                         notes=[], overlapped=pair)
    assert res["goals"]["secure_over_plain_overlapped"] == {"value": 5.6 / 5.0, "goal": "<= 1.1", "met": False}
    assert res["secure_over_plain_overlapped"] == 5.6 / 5.0
    assert {"nebula_plain_overlapped", "nebula_secure_overlapped"} <= set(res["sides"]) <= set(res["round_seconds"])
    assert [t["extra_trips"] for t in res["trips"]["nebula_secure"]] == [1, 1, 1]
    assert [t["extra_trips"] for t in res["trips"]["nebula_secure_overlapped"]] == [0, 0, 1]
    assert res["settings"]["overlapped_pair"] is True
    alone = secagg.analyse(plain, secure, None, None, demo=None, polling={"equal": True}, args=args, command="c",
                           notes=[])
    assert alone["goals"]["secure_over_plain_overlapped"] == {"value": None, "goal": "<= 1.1", "met": False}


def test_each_side_must_run_as_labelled():
    plain, secure = _nebula(overlap=True), _nebula(secure=True, overlap=True)
    for side, overlapped in ((plain, True), (secure, True), (_nebula(), False), (_nebula(secure=True), False)):
        assert secagg.overlap_problems(side, overlapped=overlapped) == []
    ev = secagg.overlap_evidence(secure)
    assert ev["pending_rounds"] == [1] and ev["late_sums"] == [[2, 1], [3, 2]] and ev["config_round_overlap"] is True
    assert secagg.overlap_evidence(plain)["trained_ahead"] == [{"round": 2, "trained_ahead": 2, "timed": 2},
                                                               {"round": 3, "trained_ahead": 2, "timed": 2}]
    # told to overlap, but the run folder records blocking rounds: each is caught
    assert "config.json" in secagg.overlap_problems({**plain, "round_overlap": False}, overlapped=True)[0]
    blocking_secure = {**_nebula(secure=True), "round_overlap": True}
    assert "unmasked at once" in secagg.overlap_problems(blocking_secure, overlapped=True)[0]
    assert "trained ahead" in secagg.overlap_problems({**_nebula(), "round_overlap": True}, overlapped=True)[0]
    untimed = _nebula(overlap=True)
    for r in untimed["rounds"]:
        r["clusters"] = {k: {"bytes_up": 1, "bytes_down": 1} for k in r["clusters"]}
    assert "overlap unproven" in secagg.overlap_problems(untimed, overlapped=True)[0]
    # and a blocking side that overlapped
    assert secagg.overlap_problems({**plain, "round_overlap": False}, overlapped=False) == [
        "x: 4 cluster-round(s) trained ahead, yet the side is blocking"]
    assert len(secagg.overlap_problems(secure, overlapped=False)) == 2  # its config, and its held and late sums
    with pytest.raises(SystemExit, match="round-overlap"):
        secagg.require_as_labelled({**secure, "round_overlap": None}, overlapped=True)


def test_a_held_round_is_not_a_problem_but_a_short_one_is():
    secure = _nebula(secure=True, overlap=True)
    assert secagg.problems(secure, 2) == []
    secure["rounds"][0]["secagg"]["uploaded"] = 1
    assert secagg.problems(secure, 2) == ["x round 1: held 1 uploads of 2"]
    assert secagg.problems(_nebula(secure=True), 2) == []


def test_a_side_is_read_back_from_its_run_folder(tmp_path):
    from safetensors.numpy import save_file

    save_file({"a": np.zeros((2, 3), dtype=np.float32), "b": np.zeros(4, dtype=np.float32)},
              str(tmp_path / "adapter.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"run_config": {"round-overlap": True}, "launcher": {}}))
    lines = [{"round": r, "seconds": 5.0 + r, "clusters_aggregated": 2, "skipped": None,
              "clusters": {c: {"bytes_up": 10, "bytes_down": 20, "seconds": 0.0 if r > 1 else 0.2, "busy_seconds": 0.2}
                           for c in ("0", "1")}} for r in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    side = secagg.read_side("p", tmp_path, secure=False)
    assert side["params"] == 10 and side["round_overlap"] is True and side["round_seconds"] == [6.0, 7.0]
    assert secagg.overlap_problems(side, overlapped=True) == []
    assert secagg.overlap_problems(side, overlapped=False) == [
        "p: its config.json says round-overlap True, expected False",
        "p: 2 cluster-round(s) trained ahead, yet the side is blocking"]
