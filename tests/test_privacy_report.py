"""The privacy report of a run folder: privacy.json, privacy.png, the table, and its errors."""

import json

import pytest
from rich.console import Console

from nebula_fl.errors import NebulaError
from nebula_fl.reports.privacy_report import build_report, print_report, privacy_report_main, write_report
from nebula_fl.storage.run_folder import RunFolder

REASON = "cluster budget ε ≤ 8 would be exceeded: 7.91 now, 8.35 after 20 more steps"


def cluster_entry(eps, steps, **extra):
    return {"bytes_up": 1000, "bytes_down": 1000, "train_loss": 0.5, "epsilon": eps, "delta": 1e-5,
            "noise_multiplier": 1.1, "sample_rate": 0.01, "dp_steps": steps, "max_grad_norm": 1.0,
            "accountant": "prv", **extra}


def fake_run(path, *, clusters=True, client=False, summary_privacy=True, budget=8.0):
    folder = RunFolder(path)
    folder.write_config({"num-server-rounds": 3})
    eps = {"0": [2.1, 3.4, 4.5], "1": [3.9, 7.91, 7.91]}
    for rnd in (1, 2, 3):
        line = {"round": rnd, "accuracy": 0.5, "clusters": {}}
        for cid in ("0", "1"):
            if not clusters:
                line["clusters"][cid] = {"bytes_up": 1, "bytes_down": 1, "train_loss": 0.4}
            elif cid == "1" and rnd == 3:
                line["clusters"][cid] = cluster_entry(7.91, 40, privacy_refused=True, privacy_reason=REASON)
            else:
                line["clusters"][cid] = cluster_entry(eps[cid][rnd - 1], 20 * rnd)
        if client:
            line["privacy"] = {"mode": "client", "epsilon": 0.5 * rnd, "delta": 1e-5, "noise_multiplier": 1.0,
                               "sample_rate": 1.0, "rounds": rnd, "accountant": "rdp"}
        folder.append_round(line)
    if clusters:
        again = {"round": 2, "clusters": {"0": cluster_entry(3.4, 40), "1": cluster_entry(7.91, 40)}}
        if client:
            again["privacy"] = {**line["privacy"], "epsilon": 1.0, "rounds": 2}
        folder.append_round(again)  # a resumed round, written again
    fields = {"status": "completed"}
    if summary_privacy:
        fields["privacy"] = {"mode": "sample", "max_epsilon": budget,
                             "clusters": {"0": {"stopped_round": None, "reason": None},
                                          "1": {"stopped_round": 3, "reason": REASON}}}
    folder.update_summary(**fields)
    return path


def test_report_json_and_png(tmp_path):
    run = fake_run(tmp_path / "run")
    json_path, png_path = write_report(run)
    assert json_path == run.resolve() / "privacy.json" and png_path == run.resolve() / "privacy.png"
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads(json_path.read_text())
    assert report == build_report(run)
    assert report["mode"] == "sample" and report["max_epsilon"] == 8.0 and report["rounds"] == 3 and report["ok"]
    c0, c1 = report["clusters"]["0"], report["clusters"]["1"]
    assert list(report["clusters"]) == ["0", "1"]
    assert c0["final"] == {"round": 3, "epsilon": 4.5, "delta": 1e-5, "noise_multiplier": 1.1, "sample_rate": 0.01,
                           "steps_total": 60, "max_grad_norm": 1.0, "accountant": "prv"}
    assert c0["mode"] == "sample"
    # one meaning per key: totals so far, and what each round alone added
    assert [r["epsilon"] for r in c0["rounds"]] == [2.1, 3.4, 4.5]
    assert [r["epsilon_spent"] for r in c0["rounds"]] == pytest.approx([2.1, 1.3, 1.1])
    assert [r["steps_total"] for r in c0["rounds"]] == [20, 40, 60]
    assert [r["steps"] for r in c0["rounds"]] == [20, 20, 20]
    assert [r["steps"] for r in c1["rounds"]] == [20, 20, 0]  # the refused round spent nothing
    assert [r["epsilon_spent"] for r in c1["rounds"]] == pytest.approx([3.9, 4.01, 0.0])
    assert c0["stopped_round"] is None and c0["within_budget"] and c0["refused_rounds"] == []
    assert c1["stopped_round"] == 3 and c1["stop_reason"] == REASON and c1["refused_rounds"] == [3]
    assert c1["final"]["epsilon"] == 7.91 and c1["final"]["steps_total"] == 40 and c1["max_epsilon"] == 8.0
    assert c1["rounds"][2]["refused"] and c1["rounds"][2]["reason"] == REASON
    assert report["client"] is None
    assert "cluster 1: final ε 7.91 within its budget ε ≤ 8; stopped at round 3" in report["verdict"]


def test_stop_is_inferred_from_the_metrics_when_the_summary_says_nothing(tmp_path):
    report = build_report(fake_run(tmp_path, summary_privacy=False))
    assert report["clusters"]["1"]["stopped_round"] == 3 and report["clusters"]["1"]["stop_reason"] == REASON
    assert report["max_epsilon"] is None and report["clusters"]["0"]["within_budget"] is None


def test_table_and_main(tmp_path):
    run = fake_run(tmp_path / "run", client=True)
    console = Console(record=True, width=200)
    assert privacy_report_main(str(run), console) == 0
    text = " ".join(console.export_text().split())  # a title wraps to its table's width
    assert "cluster 0: sample-level DP, each example's influence (prv accountant, budget ε ≤ 8)" in text
    assert "refused: cluster budget ε ≤ 8 would be exceeded" in text
    assert "client-level DP on the server" in text
    assert "privacy (ok):" in text and "wrote " in text
    report = json.loads((run / "privacy.json").read_text())
    assert report["client"]["final"]["epsilon"] == 1.5 and report["client"]["final"]["rounds_total"] == 3
    assert [r["rounds_total"] for r in report["client"]["rounds"]] == [1, 2, 3]
    assert [r["rounds"] for r in report["client"]["rounds"]] == [1, 1, 1]


def test_an_exceeded_budget_is_flagged(tmp_path):
    run = fake_run(tmp_path, budget=4.0)
    console = Console(record=True, width=200)
    assert privacy_report_main(str(run), console) == 1
    assert "BUDGET EXCEEDED" in console.export_text()


def test_client_level_only_run(tmp_path):
    report = build_report(fake_run(tmp_path, clusters=False, client=True, summary_privacy=False))
    assert report["mode"] == "client" and report["clusters"] == {}
    assert [r["epsilon"] for r in report["client"]["rounds"]] == [0.5, 1.0, 1.5]
    write_report(tmp_path)
    print_report(Console(record=True), report)


def test_errors(tmp_path):
    run = fake_run(tmp_path / "plain", clusters=False, summary_privacy=False)
    with pytest.raises(NebulaError, match=r"has no privacy records \(it ran without differential privacy\)"):
        build_report(run)
    with pytest.raises(NebulaError, match="does not exist"):
        build_report(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(NebulaError, match="not a nebula-fl run folder"):
        build_report(tmp_path / "empty")


def test_a_cluster_with_no_budget_of_its_own_is_marked(tmp_path):
    folder = RunFolder(tmp_path / "run")
    folder.write_config({"num-server-rounds": 2})
    for rnd in (1, 2):  # cluster 0's policy is off; cluster 1's is not; cluster 2 masks (no per-example figure leaves)
        folder.append_round({"round": rnd, "clusters": {
            "0": cluster_entry(200.0 * rnd, 20 * rnd, privacy_no_budget=1),
            "1": cluster_entry(1.0 * rnd, 20 * rnd, max_epsilon=8.0),
            "2": {"privacy_mode": "sample", "max_grad_norm": 1.0, "accountant": "prv", "privacy_no_budget": 1}}})
    folder.update_summary(status="completed", privacy={"mode": "sample", "clusters": {}})
    report = build_report(folder.path)
    c0, c1, c2 = (report["clusters"][cid] for cid in ("0", "1", "2"))
    assert (c0["no_budget"], c1["no_budget"], c2["no_budget"]) == (True, False, True)
    assert c0["max_epsilon"] is None and c0["final"]["epsilon"] == 400.0
    assert "cluster 0: final ε 400.00, NO BUDGET (its policy is 'off': it runs whatever differential privacy the " \
           "server asks, with no ε cap of its own)" in report["verdict"]
    assert "cluster 1: final ε 2.00 within its budget ε ≤ 8;" in report["verdict"]
    assert "cluster 2: final ε -, NO BUDGET" in report["verdict"]
    console = Console(record=True, width=200)
    print_report(console, report)
    text = " ".join(console.export_text().split())
    assert "cluster 0: sample-level DP, each example's influence (prv accountant, no budget (policy 'off'))" in text
    write_report(folder.path, report=report)  # the figure says it too, and draws the masked cluster's empty rows


def test_a_clusters_own_report_marks_the_releases_it_made_with_no_budget(tmp_path):
    from nebula_fl.privacy.cluster_ledger import LEDGER_FILE, ClusterLedger
    from nebula_fl.reports.cluster_report import build_cluster_report, print_cluster_report, write_cluster_report

    ledger = ClusterLedger(path=tmp_path / LEDGER_FILE, accountant="rdp")
    for rnd, no_budget in ((1, True), (2, True), (3, False)):  # a policy set after two rounds
        ledger.record(federation="f", round=rnd, mode="client", noise_multiplier=0.5, sample_rate=1.0, steps=1,
                      delta=1e-5, no_budget=no_budget)
    report = build_cluster_report(tmp_path)
    section = report["modes"]["client"]
    assert [row["no_budget"] for row in section["rows"]] == [True, True, False]
    assert section["no_budget_releases"] == 2
    console = Console(record=True, width=240)
    print_cluster_report(console, report)
    text = console.export_text()
    assert text.count("no budget") >= 3  # the title (no policy now), and a note on each such release
    assert "client: 2 release(s) with no budget: the policy was 'off', so this cluster ran whatever differential " \
           "privacy the server asked, with no ε cap of its own" in " ".join(text.split())
    write_cluster_report(report)
