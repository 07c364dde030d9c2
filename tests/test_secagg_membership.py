"""Who the secure-aggregation members are: the launcher's roster by default, the server's word only where a
cluster's operator opts out (its --cluster-policy), and then said in the cluster's policy and in summary.json."""

import io
import json

import pytest
from rich.console import Console

from nebula_fl.config import RunConfig
from nebula_fl.errors import ConfigError, NebulaError
from nebula_fl.launcher.federation import Federation
from nebula_fl.launcher.plan import LaunchPlan, _cluster_policies
from nebula_fl.privacy.policy import PrivacyPolicy
from nebula_fl.reports.privacy_report import build_report

TRUST = {"secagg_trust_server_membership": True}


def _federation(tmp_path, policies=None) -> Federation:
    plan = LaunchPlan(config=RunConfig(), out=tmp_path / "run", clusters=2, workers=[1, 1], devices=["cpu", "cpu"],
                      port=0, resume=False, cluster_policies=policies)
    return Federation(plan, console=Console(file=io.StringIO(), width=200))


def test_every_cluster_gets_the_launchers_roster_unless_its_operator_takes_the_servers_word(tmp_path):
    fed = _federation(tmp_path, {1: TRUST})
    roster = tmp_path / "peers.txt"
    kept = PrivacyPolicy.load(fed._write_policy(0, roster))
    opted = PrivacyPolicy.load(fed._write_policy(1, roster))
    assert kept.secagg_peers == str(roster) and not kept.secagg_trust_server_membership
    assert opted.secagg_peers is None and opted.secagg_trust_server_membership


def test_a_cluster_policy_file_may_opt_out_but_not_also_name_a_roster(tmp_path):
    (tmp_path / "trust.json").write_text(json.dumps(TRUST))
    assert _cluster_policies([f"1={tmp_path / 'trust.json'}"], 2) == {1: TRUST}
    (tmp_path / "both.json").write_text(json.dumps({**TRUST, "secagg_peers": "peers.txt"}))
    with pytest.raises(ConfigError, match="drop secagg_trust_server_membership"):
        _cluster_policies([f"0={tmp_path / 'both.json'}"], 2)


def test_summary_says_whose_membership_is_the_servers_word(tmp_path):
    fed = _federation(tmp_path, {1: TRUST})
    fed.folder.path.mkdir(parents=True)
    fed.folder.update_summary(privacy={"mode": "sample", "clusters": {"1": {"stopped_round": 3, "reason": "budget"}}})
    fed._note_membership()
    assert fed.folder.read_summary()["privacy"] == {
        "mode": "sample", "clusters": {"1": {"stopped_round": 3, "reason": "budget", "membership": "the server's word"}}}
    plain = _federation(tmp_path / "plain")  # every cluster checks the roster: summary.json is left as it was
    plain.folder.path.mkdir(parents=True)
    plain.folder.update_summary(status="completed")
    plain._note_membership()
    assert "privacy" not in plain.folder.read_summary()


def test_a_run_without_dp_whose_summary_notes_only_membership_still_reads_as_one_without_dp(tmp_path):
    fed = _federation(tmp_path, {0: TRUST})
    fed.folder.path.mkdir(parents=True)
    fed.folder.update_summary(status="completed")
    fed._note_membership()
    assert fed.folder.read_summary()["privacy"] == {"clusters": {"0": {"membership": "the server's word"}}}
    with pytest.raises(NebulaError, match=r"has no privacy records \(it ran without differential privacy\)"):
        build_report(fed.folder.path)
