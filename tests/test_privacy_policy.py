"""The cluster's own policy: a request may ask for more privacy, never less; the σ floors are Opacus's."""

import json
import math
import re
from functools import cache

import pytest
from opacus.accountants.utils import get_noise_multiplier

from nebula_fl.cli import _privacy_policy, parser
from nebula_fl.config import PrivacyConfig
from nebula_fl.errors import ConfigError
from nebula_fl.privacy.policy import DEFAULT_MAX_EPSILON, PrivacyPolicy, PrivacyRequest, admit, policy_for_run

N = 4000
Q, STEPS, PLANNED = 1 / 63, 20, 100


@cache
def derive(target, delta, rate, steps):
    """The independent reference: Opacus's own search for the σ that spends `target` (RDP: fast and exact)."""
    return get_noise_multiplier(target_epsilon=target, target_delta=delta, sample_rate=rate, steps=steps,
                                accountant="rdp", epsilon_tolerance=0.01)


def decide(policy, **asked):
    request = PrivacyRequest(**{"mode": "sample", **asked})
    return admit(policy, request, num_examples=N, sample_rate=Q, steps=STEPS, planned_steps=PLANNED,
                 derive_sigma=derive)


SAMPLE = PrivacyPolicy(mode="sample", min_noise_multiplier=1.0, max_epsilon=8.0, delta=1e-5, accountant="rdp")


def test_a_request_as_strong_as_the_policy_runs_with_what_it_asked():
    ok = decide(SAMPLE, noise_multiplier=1.2, max_epsilon=6.0)
    assert ok.allowed and ok.mode == "sample"
    assert ok.noise_multiplier == 1.2 and ok.sample_rate == Q and ok.steps == STEPS
    assert ok.delta == 1e-5 and ok.budget == 6.0  # the tighter budget applies


@pytest.mark.parametrize("asked, fragment", [
    ({"mode": "off"}, "requires 'sample'"),
    ({"mode": "client", "client_sigma": 5.0}, "requires 'sample'"),
    ({"noise_multiplier": 0.99}, "below this cluster's floor"),
    ({"noise_multiplier": 1.0, "max_epsilon": 9.0}, "more than this cluster's"),
    ({"noise_multiplier": 1.0, "delta": 1e-4}, "weaker than this cluster's δ"),
])
def test_a_weaker_request_is_refused_and_says_why(asked, fragment):
    verdict = decide(SAMPLE, **asked)
    assert not verdict.allowed and verdict.refusal == "policy"
    assert fragment in verdict.reason


PLAN = {"planned_rounds": 5, "planned_local_steps": 20, "planned_batch_size": 64}  # q = 1/⌈4000/64⌉ = Q, 100 steps


def test_a_target_epsilon_floor_is_the_sigma_opacus_finds_for_the_planned_steps():
    policy = PrivacyPolicy(mode="sample", target_epsilon=4.0, delta=1e-5, accountant="rdp", **PLAN)
    floor = derive(4.0, 1e-5, Q, PLANNED)
    assert decide(policy, noise_multiplier=floor).allowed
    assert not decide(policy, noise_multiplier=floor * 0.99).allowed
    assert decide(policy, target_epsilon=3.0).allowed  # a smaller ε target is more privacy
    low = decide(policy, target_epsilon=5.0)
    assert not low.allowed and "below this cluster's floor" in low.reason
    assert decide(policy, target_epsilon=4.0).budget == 4.0  # the target is the lifetime budget by default


def test_an_off_policy_admits_any_request_and_a_stricter_delta_keeps_its_own_budget():
    off = PrivacyPolicy()
    assert decide(off, mode="off").allowed and decide(off, mode="off").mode == "off"
    verdict = decide(off, noise_multiplier=0.8, delta=1e-7, max_epsilon=3.0)
    assert verdict.allowed and verdict.mode == "sample"
    assert verdict.delta == min(1e-5, 1 / (10 * N))  # the cluster's own δ, always accounted
    assert (verdict.request_delta, verdict.request_budget) == (1e-7, 3.0)


def test_client_level_noise_is_judged_per_release_without_sampling_amplification():
    policy = PrivacyPolicy(mode="client", min_noise_multiplier=1.0, max_epsilon=10.0)
    ok = decide(policy, mode="client", client_sigma=2.0, noise_shares=4)
    assert ok.allowed and ok.noise_multiplier == pytest.approx(1.0) and ok.sample_rate == 1.0 and ok.steps == 1
    # splitting the noise more finely makes each release weaker than the policy allows
    thin = decide(policy, mode="client", client_sigma=2.0, noise_shares=5)
    assert not thin.allowed and "σ/√shares" in thin.reason
    assert not decide(policy, mode="client", client_sigma=0.0).allowed


def test_defaults_a_privacy_engineer_accepts():
    assert PrivacyPolicy(mode="sample", min_noise_multiplier=1).resolved_delta(100) == 1e-5
    assert PrivacyPolicy(mode="sample", min_noise_multiplier=1).resolved_delta(10**6) == pytest.approx(1e-7)
    assert PrivacyPolicy(mode="client", min_noise_multiplier=1).resolved_delta(10) == 1e-5
    with pytest.raises(ConfigError, match="not below 1/n"):
        PrivacyPolicy(mode="sample", min_noise_multiplier=1, delta=0.01).check_for(100)


@pytest.mark.parametrize("fields, fragment", [
    ({"mode": "sample"}, "exactly one of"),
    ({"mode": "sample", "min_noise_multiplier": 0.0}, "min_noise_multiplier"),
    ({"mode": "sample", "min_noise_multiplier": math.nan}, "min_noise_multiplier"),
    ({"mode": "sample", "target_epsilon": math.inf}, "target_epsilon"),
    ({"mode": "sample", "min_noise_multiplier": 1, "delta": 1.0}, "delta"),
    ({"mode": "loud"}, "mode"),
    ({"mode": "off", "colour": "red"}, "unknown field"),
])
def test_bad_policies_are_refused_in_one_sentence(fields, fragment):
    with pytest.raises(ConfigError, match=fragment):
        PrivacyPolicy.from_dict(fields)


def test_a_policy_file_round_trips_and_the_launchers_policy_is_the_run_request(tmp_path):
    asked = PrivacyConfig(mode="sample", target_epsilon=8.0, max_epsilon=8.0, accountant="rdp", batch_size=64)
    policy = policy_for_run(asked, rounds=5, local_steps=20)
    assert (policy.planned_rounds, policy.planned_local_steps, policy.planned_batch_size) == (5, 20, 64)
    policy.save(tmp_path / "p.json")
    assert PrivacyPolicy.load(tmp_path / "p.json") == policy
    request = PrivacyRequest(mode="sample", target_epsilon=8.0, max_epsilon=8.0)
    assert admit(policy, request, num_examples=N, sample_rate=Q, steps=STEPS, planned_steps=PLANNED,
                 derive_sigma=derive).allowed
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        PrivacyPolicy.load(tmp_path / "bad.json")


def test_the_floor_is_the_operators_plan_whatever_the_request_says_its_plan_is():
    policy = PrivacyPolicy(mode="sample", target_epsilon=4.0, delta=1e-5, accountant="rdp", **PLAN)
    floor = derive(4.0, 1e-5, Q, PLANNED)
    for rate, planned in ((Q, PLANNED), (Q, 1), (1 / 400, PLANNED), (0.5, 10_000)):
        kw = dict(num_examples=N, sample_rate=rate, steps=STEPS, planned_steps=planned, derive_sigma=derive)
        assert admit(policy, PrivacyRequest(mode="sample", noise_multiplier=floor), **kw).allowed
        low = admit(policy, PrivacyRequest(mode="sample", noise_multiplier=floor * (1 - 1e-6)), **kw)
        assert not low.allowed and f"floor σ ≥ {floor:.4g}" in low.reason
    # without the batch, the plan's q is the DP recipe's: an eighth of the examples
    recipe = PrivacyPolicy(mode="sample", target_epsilon=4.0, delta=1e-5, accountant="rdp", planned_rounds=5,
                           planned_local_steps=20)
    assert recipe.planned_releases(N) == (1 / 8, 100)
    client = PrivacyPolicy(mode="client", target_epsilon=4.0, planned_rounds=30)
    assert client.planned_releases(N) == (1.0, 30)  # one release a round, no sampling amplification


def test_a_dp_policy_without_a_budget_gets_the_default_one():
    floor_only = PrivacyPolicy(mode="sample", min_noise_multiplier=1.0)
    assert floor_only.budget == DEFAULT_MAX_EPSILON == 10 and floor_only.budget_is_default
    assert PrivacyPolicy(mode="client", min_noise_multiplier=1.0).budget == 10
    assert PrivacyPolicy().budget is None and not PrivacyPolicy().budget_is_default  # off: no requirement
    target = PrivacyPolicy(mode="sample", target_epsilon=4.0, **PLAN)
    assert target.budget == 4.0 and not target.budget_is_default
    over = decide(floor_only, noise_multiplier=1.0, max_epsilon=12.0)
    assert not over.allowed and "ε ≤ 10" in over.reason
    assert decide(floor_only, noise_multiplier=1.0).budget == 10


@pytest.mark.parametrize("fields, fragment, fix", [
    ({"mode": "sample", "target_epsilon": 8}, "not planned_rounds and planned_local_steps", "min_noise_multiplier"),
    ({"mode": "sample", "target_epsilon": 8, "planned_rounds": 5}, "not planned_local_steps:", "min_noise_multiplier"),
    ({"mode": "client", "target_epsilon": 8}, "not planned_rounds:", "min_noise_multiplier instead"),
    ({"mode": "sample", "min_noise_multiplier": 1, "secagg_peers": "/nonexistent/peers.json"}, "not a file", "roster"),
])
def test_the_trainer_refuses_to_start_without_a_plan_or_a_roster(fields, fragment, fix):
    policy = PrivacyPolicy.from_dict(fields)  # a file of an older version still loads
    with pytest.raises(ConfigError, match=fragment) as err:
        policy.check_for(N)
    assert "\n" not in str(err.value) and fix in str(err.value)


@pytest.mark.parametrize("fields, fragment", [
    ({"mode": "sample", "target_epsilon": 8, "planned_rounds": 0}, "'planned_rounds' is 0"),
    ({"mode": "sample", "target_epsilon": 8, "planned_rounds": True}, "'planned_rounds' is True"),
    ({"mode": "sample", "target_epsilon": 8, "planned_local_steps": 2.5}, "'planned_local_steps' is 2.5"),
    ({"mode": "client", "target_epsilon": 8, "planned_rounds": 5, "planned_local_steps": 10}, "for mode 'sample' only"),
    ({"min_secagg_threshold": 3}, "without 'require_secure_aggregation'"),
    ({"min_secagg_clusters": 3, "secagg_peers": "p.json"}, "without 'require_secure_aggregation'"),
    ({"require_secure_aggregation": True}, "server could count clusters of its own"),
    ({"require_secure_aggregation": "yes", "secagg_peers": "p.json"}, "use true or false"),
    ({"require_secure_aggregation": True, "secagg_peers": "p.json", "min_secagg_threshold": 1}, "from 2"),
    ({"require_secure_aggregation": True, "secagg_peers": "p.json", "min_secagg_threshold": 4,
      "min_secagg_clusters": 3}, "below the threshold 4; use at least 4"),
    ({"require_secure_aggregation": True, "secagg_peers": ""}, "'secagg_peers' is ''"),
    ({"secagg_trust_server_membership": "yes"}, "'secagg_trust_server_membership' is 'yes'; use true or false"),
    ({"secagg_trust_server_membership": True, "secagg_peers": "p.json"}, "drop secagg_trust_server_membership"),
    ({"secagg_trust_server_membership": True, "require_secure_aggregation": True}, "give 'secagg_peers' (the roster)"),
])
def test_bad_plans_and_secure_aggregation_requirements_are_refused_in_one_sentence(fields, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)) as err:
        PrivacyPolicy.from_dict(fields)
    assert "\n" not in str(err.value)


def test_the_secure_aggregation_requirement_defaults_and_round_trips(tmp_path):
    peers = str(tmp_path / "peers.json")
    required = PrivacyPolicy(require_secure_aggregation=True, secagg_peers=peers)
    assert (required.secagg_threshold, required.secagg_clusters) == (2, 2)
    three = PrivacyPolicy(require_secure_aggregation=True, secagg_peers=peers, min_secagg_threshold=3)
    assert (three.secagg_threshold, three.secagg_clusters) == (3, 3)
    roster_only = PrivacyPolicy(secagg_peers=peers)  # the roster alone, without the requirement
    assert (roster_only.secagg_threshold, roster_only.secagg_clusters) == (None, None)
    full = PrivacyPolicy(mode="sample", target_epsilon=6.0, max_epsilon=8.0, accountant="rdp", **PLAN,
                         require_secure_aggregation=True, secagg_peers=peers, min_secagg_threshold=3,
                         min_secagg_clusters=5)
    for policy in (required, three, roster_only, full):
        assert PrivacyPolicy.from_dict(policy.to_dict()) == policy
        policy.save(tmp_path / "p.json")
        assert PrivacyPolicy.load(tmp_path / "p.json") == policy
    (tmp_path / "old.json").write_text('{"mode": "sample", "min_noise_multiplier": 1.1, "max_epsilon": 8}')
    old = PrivacyPolicy.load(tmp_path / "old.json")
    assert not old.require_secure_aggregation and old.secagg_peers is None and old.planned_rounds is None
    assert set(old.to_dict()) == {"mode", "min_noise_multiplier", "max_epsilon", "accountant",
                                  "require_secure_aggregation", "secagg_trust_server_membership"}
    assert not old.secagg_trust_server_membership  # no roster and no opt-out: masked rounds are refused
    trusting = PrivacyPolicy(secagg_trust_server_membership=True)  # the opt-out, without a requirement
    assert PrivacyPolicy.from_dict(trusting.to_dict()) == trusting


def test_trainer_flags_set_every_new_field_and_override_the_file(tmp_path, monkeypatch):
    (tmp_path / "ops").mkdir()
    (tmp_path / "ops" / "policy.json").write_text(json.dumps(
        {"mode": "sample", "target_epsilon": 8, "planned_rounds": 5, "planned_local_steps": 20,
         "secagg_peers": "roster.json"}))
    base = ["trainer", "--socket", "s", "--privacy-policy", str(tmp_path / "ops" / "policy.json")]
    from_file = _privacy_policy(parser().parse_args(base))
    assert from_file.secagg_peers == str(tmp_path / "ops" / "roster.json")  # beside the file it was named in
    monkeypatch.chdir(tmp_path)
    flags = ["--planned-rounds", "50", "--planned-local-steps", "10", "--planned-batch-size", "256",
             "--require-secure-aggregation", "--min-secagg-threshold", "3", "--min-secagg-clusters", "4",
             "--secagg-peers", "mine.json"]
    policy = _privacy_policy(parser().parse_args(base + flags))
    assert (policy.planned_rounds, policy.planned_local_steps, policy.planned_batch_size) == (50, 10, 256)
    assert policy.require_secure_aggregation and (policy.secagg_threshold, policy.secagg_clusters) == (3, 4)
    assert policy.secagg_peers == str(tmp_path / "mine.json") and policy.target_epsilon == 8
    assert not policy.secagg_trust_server_membership
    opted = _privacy_policy(parser().parse_args(["trainer", "--socket", "s", "--secagg-trust-server-membership"]))
    assert opted.secagg_trust_server_membership and opted.secagg_peers is None
    with pytest.raises(ConfigError, match="drop secagg_trust_server_membership"):  # the file's roster, and the flag
        _privacy_policy(parser().parse_args([*base, "--secagg-trust-server-membership"]))


def test_the_launchers_policy_plans_the_run_it_writes_for():
    client = policy_for_run(PrivacyConfig(mode="client", target_epsilon=8.0), rounds=7, local_steps=20)
    assert (client.planned_rounds, client.planned_local_steps, client.planned_batch_size) == (7, None, None)
    auto = policy_for_run(PrivacyConfig(mode="sample", target_epsilon=8.0), rounds=7, local_steps=20)
    assert (auto.planned_rounds, auto.planned_local_steps, auto.planned_batch_size) == (7, 20, None)  # recipe's batch
    floor = policy_for_run(PrivacyConfig(mode="sample", noise_multiplier=1.0), rounds=7, local_steps=20)
    assert floor.planned_rounds is None and floor.budget_is_default
