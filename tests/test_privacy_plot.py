"""The privacy figure a data owner reads, and the files `privacy-report` writes.

Every cluster stays visible when clusters spent exactly the same ε, the caption says the unit and δ in plain
words, "why round 1 cost most" appears only when the numbers bear it out (checked against the exact Gaussian
composition), each table column has one meaning, and a state folder gets the names `--help` promises.
"""

import json
import math
from itertools import pairwise

import matplotlib.figure
import pytest
from opacus.accountants import RDPAccountant
from scipy.optimize import brentq
from scipy.stats import norm

from nebula_fl import cli
from nebula_fl.privacy.cluster_ledger import ClusterLedger
from nebula_fl.privacy.policy import PrivacyPolicy
from nebula_fl.reports import privacy_plot as plot
from nebula_fl.reports.cluster_report import build_cluster_report, release_headers
from nebula_fl.reports.cluster_report import figure_of as cluster_figure
from nebula_fl.reports.privacy_report import build_report, figure_of, tables, write_report
from nebula_fl.storage.run_folder import RunFolder

EPS = [5.3, 6.42, 7.27, 8.0]  # the smoke run's ε after each of 4 rounds of 3 steps (σ 0.674, q 0.125, PRV)


def identical_run(path, *, clusters, mode="sample"):
    """A run whose clusters all spent the same ε, as clusters with one policy and one data size do."""
    folder = RunFolder(path)
    folder.write_config({})
    per_round = 3 if mode == "sample" else 1
    for rnd, eps in enumerate(EPS, start=1):
        entry = {"epsilon": eps, "epsilon_federation": eps, "delta": 1e-5, "noise_multiplier": 0.674,
                 "sample_rate": 0.125 if mode == "sample" else 1.0, "dp_steps": per_round * rnd,
                 "max_grad_norm": 1.0, "accountant": "prv", "max_epsilon": 8.0, "privacy_mode": mode}
        folder.append_round({"round": rnd, "clusters": {str(c): dict(entry) for c in range(clusters)}})
    folder.update_summary(status="completed", privacy={"mode": mode, "max_epsilon": 8.0, "clusters": {}})
    return path


def caption(fig):
    return " ".join(" ".join(text.get_text() for text in fig.texts).split())


def exact_gaussian_epsilon(mu, delta):
    """Independent reference (Balle & Wang 2018): ε of a Gaussian mechanism of sensitivity/σ = μ at δ, exactly."""
    gap = lambda eps: norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2) - delta  # noqa: E731
    return brentq(gap, 0.0, 200.0, xtol=1e-12)


@pytest.mark.parametrize("clusters", [2, 8])
def test_clusters_with_identical_epsilon_each_stay_visible(tmp_path, clusters):
    fig = plot.draw(figure_of(build_report(identical_run(tmp_path, clusters=clusters))))
    top, bottom = fig.axes
    lines = [line for line in top.get_lines() if line.get_label().startswith("cluster ")]
    assert len(lines) == clusters
    assert len({(line.get_color(), line.get_marker()) for line in lines}) == clusters
    assert len({line.get_linestyle() for line in lines}) == min(clusters, len(plot.LINESTYLES))
    for line in lines:
        assert list(line.get_ydata()) == EPS  # the same numbers, drawn as they are
        assert all(abs(x - rnd) < 0.5 for x, rnd in zip(line.get_xdata(), range(1, 5), strict=True))
    assert len({tuple(line.get_xdata()) for line in lines}) == clusters  # side by side, none under another
    legend = [text.get_text() for text in fig.legends[0].get_texts()]
    assert legend[0] == "cluster 0: ε = 8.00"
    assert legend[1:] == [f"cluster {c}: ε = 8.00 (same as cluster 0)" for c in range(1, clusters)]
    assert len(bottom.patches) == 4 * clusters  # a bar per cluster per round
    heights = sorted(round(bar.get_height(), 6) for bar in bottom.patches)
    assert heights == sorted([round(v, 6) for v in (5.3, 1.12, 0.85, 0.73)] * clusters)
    budget = [line for line in top.get_lines() if list(line.get_ydata()) == [8.0, 8.0]]
    assert len(budget) == 1 and any(t.get_text() == "budget: ε ≤ 8 (all clusters)" for t in top.texts)
    fig.clf()


def test_the_caption_says_the_unit_and_delta_in_plain_words(tmp_path):
    fig = plot.draw(figure_of(build_report(identical_run(tmp_path / "s", clusters=2))))
    words = caption(fig)
    assert "ε measures each example's influence" in words
    assert "δ = 1e-05: a 1 in 100,000 chance that this ε bound does not hold" in words
    assert "PRV accountant" in words and "σ = 0.674" in words and "q = 0.125" in words
    assert "mode" not in words
    assert fig.axes[0].get_ylabel() == "total ε so far\n(each example's influence)"
    # ε per step fell every round, so the caption explains the first round, with its share of the total
    assert "Why round 1 cost the most (66% of each cluster's total ε)" in words
    assert "cluster 0's 12 steps cost 1.5× the ε of its first 3 steps" in words
    client = plot.draw(figure_of(build_report(identical_run(tmp_path / "c", clusters=3, mode="client"))))
    words = caption(client)
    assert "ε measures each cluster's whole update" in words and "1 in 100,000" in words
    assert "cluster 0's 4 updates cost 1.5× the ε of its first update" in words
    assert plot.chance(2e-5) == "1 in 50,000" and plot.chance(3e-5) == "3e-05"


def test_no_first_round_story_where_the_numbers_do_not_bear_it_out():
    steady = plot.Series(label="cluster 0", x=(1, 2, 3), epsilon=(1.0, 1.8, 2.4), spent=(1.0, 0.8, 0.6),
                         steps=(10, 10, 10))
    assert plot.first_round_note([steady]).startswith("Why round 1 cost the most (42% of the total ε)")
    # σ lowered in round 2: that round cost more per step than the first, so no "why" is claimed
    louder = plot.Series(label="cluster 1", x=(1, 2, 3), epsilon=(1.0, 2.5, 3.0), spent=(1.0, 1.5, 0.5),
                         steps=(10, 10, 10))
    assert plot.first_round_note([steady, louder]) == ""
    # more steps in round 2 but less ε per step: still true, and said per step
    more = plot.Series(label="cluster 2", x=(1, 2), epsilon=(1.0, 2.5), spent=(1.0, 1.5), steps=(10, 30))
    assert plot.first_round_note([more]) != ""
    unknown = plot.Series(label="cluster 3", x=(1, 2), epsilon=(4.0, 5.0), spent=(None, 1.0), steps=(None, 10))
    assert plot.first_round_note([unknown]) == ""


def test_the_first_round_explanation_holds_for_the_exact_composition(tmp_path):
    # client-level releases (q = 1): k releases at σ compose to exactly one Gaussian of μ = √k / σ
    sigma, delta, rounds = 1.202392578125, 1e-5, 4  # the smoke run's client-level σ for ε = 8 over 4 rounds
    state = tmp_path / "state"
    ledger = ClusterLedger(path=state / "privacy-ledger.jsonl", accountant="prv")
    for rnd in range(1, rounds + 1):
        ledger.record(federation="f", round=rnd, mode="client", noise_multiplier=sigma, sample_rate=1.0, steps=1,
                      delta=delta)
    report = build_cluster_report(state)
    rows = report["modes"]["client"]["rows"]
    exact = [exact_gaussian_epsilon(math.sqrt(k) / sigma, delta) for k in range(1, rounds + 1)]
    for row, truth in zip(rows, exact, strict=True):  # PRV reports an upper bound, within eps_error (0.01)
        assert truth - 1e-6 <= row["epsilon"] <= truth + 0.011
    increments = [exact[0]] + [b - a for a, b in pairwise(exact)]
    assert all(later < earlier for earlier, later in pairwise(increments))
    words = caption(plot.draw(cluster_figure(report)))
    share = f"{exact[0] / exact[-1]:.0%}"
    assert f"Why round 1 cost the most ({share} of the total ε)" in words
    # per-example DP, the smoke run's 4 rounds of 3 steps: Opacus's RDP accountant, stepped one step at a time (a
    # reference apart from the PRV the run used), charges less every round (and never more for a later step)
    reference, per_step, before = RDPAccountant(), [], 0.0
    for _ in range(12):
        reference.step(noise_multiplier=0.6744384765625, sample_rate=0.125)
        eps = reference.get_epsilon(delta=delta)
        per_step.append(eps - before)
        before = eps
    assert all(later <= earlier + 1e-9 for earlier, later in pairwise(per_step))
    per_round = [sum(per_step[i:i + 3]) for i in range(0, 12, 3)]
    assert all(later < earlier for earlier, later in pairwise(per_round))


def test_each_column_has_one_meaning(tmp_path):
    state = tmp_path / "state"
    ledger = ClusterLedger(path=state / "privacy-ledger.jsonl", accountant="rdp")
    for rnd in (1, 2, 3):
        ledger.record(federation="f", round=rnd, mode="sample", noise_multiplier=1.0, sample_rate=0.05, steps=20,
                      delta=1e-5)
    PrivacyPolicy(mode="sample", min_noise_multiplier=1.0, accountant="rdp").save(state / "privacy-policy.json")
    section = build_cluster_report(state)["modes"]["sample"]
    assert [r["steps"] for r in section["rows"]] == [20, 20, 20]
    assert [r["steps_total"] for r in section["rows"]] == [20, 40, 60] and section["steps_total"] == 60
    assert [r["epsilon_spent"] for r in section["rows"]] == pytest.approx(
        [section["rows"][0]["epsilon"]] + [b["epsilon"] - a["epsilon"] for a, b in pairwise(section["rows"])])
    assert "steps" not in section  # the old per-mode "steps" was a total under a per-release name
    headers = release_headers("sample")
    assert len(set(headers)) == len(headers) and {"steps", "steps total", "ε spent", "ε total"} <= set(headers)
    assert {"updates", "updates total"} <= set(release_headers("client"))

    run = build_report(identical_run(tmp_path / "run", clusters=1))
    table = tables(run)[0]
    columns = {column.header.replace("\n", " "): list(column._cells) for column in table.columns}
    assert len(columns) == len(table.columns)
    assert columns["steps"] == ["3", "3", "3", "3"] and columns["steps total"] == ["3", "6", "9", "12"]
    assert columns["ε total"] == [f"{e:.4f}" for e in EPS]
    assert columns["ε spent"] == ["5.3000", "1.1200", "0.8500", "0.7300"]


def test_a_lifetime_ledger_that_spent_before_the_run_has_no_first_bar(tmp_path):
    folder = RunFolder(tmp_path)
    folder.write_config({})
    for rnd, (eps, own) in enumerate([(6.0, 2.0), (6.5, 3.0)], start=1):
        folder.append_round({"round": rnd, "clusters": {"0": {
            "epsilon": eps, "epsilon_federation": own, "delta": 1e-5, "noise_multiplier": 1.0, "sample_rate": 0.1,
            "dp_steps": 100 + 10 * rnd, "max_grad_norm": 1.0, "accountant": "rdp", "privacy_mode": "sample"}}})
    rows = build_report(tmp_path)["clusters"]["0"]["rounds"]
    assert [r["epsilon_spent"] for r in rows] == [None, 0.5] and [r["steps"] for r in rows] == [None, 10]
    words = caption(plot.draw(figure_of(build_report(tmp_path))))
    assert "had spent privacy in earlier federations" in words


def report_help():
    (action,) = [a for a in cli.parser()._actions if a.dest == "command"]
    return " ".join(action.choices["privacy-report"].format_help().split())


def test_privacy_report_writes_what_help_promises_for_a_state_dir_and_a_run(tmp_path, capsys):
    promised = report_help()
    assert "privacy.json" in promised and "privacy.png" in promised
    state = tmp_path / "clusters" / "0" / "state"
    ledger = ClusterLedger(path=state / "privacy-ledger.jsonl", accountant="rdp")
    for rnd in (1, 2):
        ledger.record(federation="f", round=rnd, mode="sample", noise_multiplier=1.0, sample_rate=0.05, steps=20,
                      delta=1e-5)
    before = set(p.name for p in state.iterdir())
    assert cli.main(["privacy-report", str(state)]) == 0
    written = set(p.name for p in state.iterdir()) - before
    assert written == {"privacy.json", "privacy.png"} and all(name in promised for name in written)
    assert json.loads((state / "privacy.json").read_text())["modes"]["sample"]["releases"] == 2
    assert (state / "privacy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    run = identical_run(tmp_path / "run", clusters=2)
    before = set(p.name for p in run.iterdir())
    assert cli.main(["privacy-report", str(run)]) == 0
    assert set(p.name for p in run.iterdir()) - before == {"privacy.json", "privacy.png"}
    out = capsys.readouterr().out
    assert "privacy.json" in out and "privacy.png" in out
    # a cluster that has released nothing still gets both files, the figure saying so
    empty = tmp_path / "empty"
    empty.mkdir()
    PrivacyPolicy(mode="sample", min_noise_multiplier=1.0).save(empty / "privacy-policy.json")
    assert cli.main(["privacy-report", str(empty)]) == 0
    assert {p.name for p in empty.iterdir()} >= {"privacy.json", "privacy.png"}


def test_a_failed_write_leaves_the_old_figure_and_no_partial_file(tmp_path, monkeypatch):
    run = identical_run(tmp_path, clusters=2)
    write_report(run)
    old = (run / "privacy.png").read_bytes()

    def torn(self, path, **kwargs):
        with open(path, "wb") as f:
            f.write(b"\x89PNG half")
        raise OSError("disk full")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", torn)
    with pytest.raises(OSError, match="disk full"):
        write_report(run)
    assert (run / "privacy.png").read_bytes() == old
    assert not [p.name for p in run.iterdir() if p.name.startswith(".privacy")]
