"""Budgets: default δ, the steps that still fit, the σ for a target ε, and the round verdict."""

import time

import pytest

from nebula_fl.errors import ConfigError
from nebula_fl.privacy.budget import (
    BudgetDecision,
    _show,
    decide_round,
    default_delta,
    epsilon_floor,
    noise_for_target,
    steps_within_budget,
)
from nebula_fl.privacy.ledger import PrivacyLedger

MECH = {"noise_multiplier": 1.5, "sample_rate": 0.04}


def ledger_at(accountant="rdp", steps=1000, delta=1e-5):
    ledger = PrivacyLedger(accountant=accountant, delta=delta)
    ledger.record(steps=steps, **MECH)
    return ledger


def test_default_delta_is_one_over_ten_n():
    assert default_delta(1) == 0.1
    assert default_delta(2225) == pytest.approx(1 / 22250)
    for bad in (0, -3, 2.5, True, "10"):
        with pytest.raises(ConfigError):
            default_delta(bad)


def test_a_ledger_at_its_budget_refuses_even_one_step():
    ledger = ledger_at()
    budget = ledger.epsilon()
    assert steps_within_budget(ledger=ledger, max_epsilon=budget, max_steps=50, **MECH) == 0
    decision = decide_round(ledger=ledger, max_epsilon=budget, steps=1, **MECH)
    assert isinstance(decision, BudgetDecision) and not decision.allowed
    assert decision.epsilon_now == budget and decision.epsilon_after > budget
    assert decide_round(ledger=ledger, max_epsilon=budget, steps=0, **MECH).allowed


def test_the_boundary_is_exact_k_allowed_and_k_plus_one_not():
    ledger = ledger_at()
    k = 37
    budget = ledger.epsilon_after(steps=k, **MECH)
    assert steps_within_budget(ledger=ledger, max_epsilon=budget, max_steps=100, **MECH) == k
    assert decide_round(ledger=ledger, max_epsilon=budget, steps=k, **MECH).allowed
    refused = decide_round(ledger=ledger, max_epsilon=budget, steps=k + 1, **MECH)
    assert not refused.allowed
    assert ledger.steps_total == 1000  # deciding records nothing
    assert steps_within_budget(ledger=ledger, max_epsilon=budget, max_steps=20, **MECH) == 20  # all fit
    assert steps_within_budget(ledger=ledger, max_epsilon=budget, max_steps=0, **MECH) == 0


def test_the_refusal_reason_says_budget_now_and_after():
    ledger = ledger_at(steps=2250)  # ε 7.33
    decision = decide_round(ledger=ledger, max_epsilon=7.4, steps=200, **MECH)
    assert not decision.allowed
    assert decision.reason == (f"cluster budget ε ≤ 7.4 would be exceeded: 7.33 now, "
                               f"{decision.epsilon_after:.2f} after 200 more steps")
    assert decide_round(ledger=ledger, max_epsilon=8, steps=20, **MECH).reason.startswith("cluster budget ε ≤ 8 is kept")
    # a refusal never prints an ε that rounds to the budget
    assert _show(8.004, 8.0) == "8.004" and _show(7.91, 8.0) == "7.91" and _show(8.0, 8.0) == "8.00"


def test_prv_boundary_is_exact_too():
    ledger = ledger_at("prv", steps=200)
    k = 21
    budget = ledger.epsilon_after(steps=k, **MECH)
    found = steps_within_budget(ledger=ledger, max_epsilon=budget, max_steps=40, **MECH)
    assert found >= k
    assert ledger.epsilon_after(steps=found, **MECH) <= budget < ledger.epsilon_after(steps=found + 1, **MECH)


def test_budget_must_be_positive():
    for bad in (0, -1, float("nan"), "8"):
        with pytest.raises(ConfigError, match="max-epsilon"):
            decide_round(ledger=ledger_at(), max_epsilon=bad, steps=1, **MECH)
    assert decide_round(ledger=ledger_at(), max_epsilon=float("inf"), steps=10**6, **MECH).allowed


def test_noise_for_target_reaches_the_target_from_below():
    sigma = noise_for_target(target_epsilon=3.0, delta=1e-5, sample_rate=0.04, steps=2000, accountant="rdp")
    ledger = PrivacyLedger(accountant="rdp", delta=1e-5)
    ledger.record(noise_multiplier=sigma, sample_rate=0.04, steps=2000)
    assert 3.0 - 0.01 <= ledger.epsilon() <= 3.0


def test_noise_for_target_with_prv():
    sigma = noise_for_target(target_epsilon=2.0, delta=1e-5, sample_rate=0.05, steps=100, accountant="prv")
    ledger = PrivacyLedger(accountant="prv", delta=1e-5)
    ledger.record(noise_multiplier=sigma, sample_rate=0.05, steps=100)
    assert 2.0 - 0.02 <= ledger.epsilon() <= 2.0


def test_an_unreachable_target_is_a_clear_error_and_fast():
    floor = epsilon_floor(delta=1e-5, accountant="rdp")
    assert 0.05 < floor < 0.2
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"target ε = 0\.05 at δ = 1e-05 is unreachable over 2000 steps"):
        noise_for_target(target_epsilon=0.05, delta=1e-5, sample_rate=0.5, steps=2000, accountant="rdp")
    assert time.monotonic() - start < 1.0
    with pytest.raises(ConfigError, match="unreachable"):
        noise_for_target(target_epsilon=0.005, delta=1e-5, sample_rate=0.5, steps=10, accountant="prv")
