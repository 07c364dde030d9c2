"""benchmarks/secagg.py without running a federation: nebula-fl's polling read from its code, the per-side
polling report (equal sides pass, any difference is a note), and the results keep their keys with the demo
pair beside the 8-cluster figures."""

from __future__ import annotations

import argparse
import inspect

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


def _nebula(secure=False, rounds=3, clusters=2, seconds=(10.0, 8.0, 9.0), up=100):
    rows = [{"round": i + 1, "seconds": s, "accuracy": 0.5, "clusters_aggregated": clusters, "skipped": None,
             "secagg": {"setup_s": 2.0} if secure and i == 0 else ({"unmask_s": 0.5} if secure else None),
             "clusters": {str(c): {"bytes_up": up, "bytes_down": 50} for c in range(clusters)}}
            for i, s in enumerate(seconds[:rounds])]
    return {"name": "x", "secure": secure, "folder": "f", "params": 1000, "round_seconds": list(seconds[:rounds]),
            "rounds": rows, "wall_s": 60.0, "superexec_task_poll_s": WATCHED}


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
