"""The cluster's own policy: a request may ask for more privacy, never less; the σ floors are Opacus's."""

import math

import pytest
from opacus.accountants.utils import get_noise_multiplier

from nebula_fl.config import PrivacyConfig
from nebula_fl.errors import ConfigError
from nebula_fl.privacy.policy import PrivacyPolicy, PrivacyRequest, admit, policy_for_run

N = 4000
Q, STEPS, PLANNED = 1 / 63, 20, 100


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


def test_a_target_epsilon_floor_is_the_sigma_opacus_finds_for_the_planned_steps():
    policy = PrivacyPolicy(mode="sample", target_epsilon=4.0, delta=1e-5, accountant="rdp")
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
    asked = PrivacyConfig(mode="sample", target_epsilon=8.0, max_epsilon=8.0, accountant="rdp")
    policy = policy_for_run(asked)
    policy.save(tmp_path / "p.json")
    assert PrivacyPolicy.load(tmp_path / "p.json") == policy
    request = PrivacyRequest(mode="sample", target_epsilon=8.0, max_epsilon=8.0)
    assert admit(policy, request, num_examples=N, sample_rate=Q, steps=STEPS, planned_steps=PLANNED,
                 derive_sigma=derive).allowed
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        PrivacyPolicy.load(tmp_path / "bad.json")
