"""The privacy ledger against independent reference values, composition, monotonicity and resume."""

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nebula_fl.errors import ConfigError
from nebula_fl.privacy.ledger import PrivacyLedger, epsilon_of

EPS_ERROR = 0.01  # Opacus PRV's default, what the ledger reports its upper bound with

# shared/NOTES.md "Privacy reference values" (δ = 1e-5): (q, σ, steps, Opacus RDP, Opacus PRV upper, dp-accounting PLD)
REFERENCE = [
    (0.04, 1.5, 2250, 7.32911, 6.77913, 6.76879),
    (0.01, 4.0, 10000, 1.03549, 0.95694, 0.94700),
    (0.01, 2.0, 10000, 2.35291, 2.17284, 2.16277),
    (256 / 60000, 1.1, 14062, 2.59656, 2.39174, 2.38169),
]


def ledger_with(accountant, *records, delta=1e-5):
    ledger = PrivacyLedger(accountant=accountant, delta=delta)
    for sigma, q, steps in records:
        ledger.record(noise_multiplier=sigma, sample_rate=q, steps=steps)
    return ledger


# -- reference values ----------------------------------------------------------------------------
@pytest.mark.parametrize(("q", "sigma", "steps", "rdp"), [row[:4] for row in REFERENCE])
def test_rdp_matches_the_reference_table(q, sigma, steps, rdp):
    assert ledger_with("rdp", (sigma, q, steps)).epsilon() == pytest.approx(rdp, abs=1e-4)


def test_prv_matches_opacus_own_pinned_value_at_2249_steps():
    assert abs(ledger_with("prv", (1.5, 0.04, 2249)).epsilon() - 6.777395712) <= EPS_ERROR


@pytest.mark.parametrize(("q", "sigma", "steps", "prv", "pld"), [REFERENCE[0][:3] + REFERENCE[0][4:],
                                                                  REFERENCE[1][:3] + REFERENCE[1][4:]])
def test_prv_upper_bound_matches_the_table_and_brackets_the_pld_value(q, sigma, steps, prv, pld):
    eps = ledger_with("prv", (sigma, q, steps)).epsilon()
    assert abs(eps - prv) <= EPS_ERROR
    # the independent PLD accountant's estimate sits below the PRV upper bound, by at most its two error bars
    assert pld - 1e-3 <= eps <= pld + 2 * EPS_ERROR


def test_prv_is_tighter_than_rdp_and_handles_a_single_step_and_q_equal_one():
    assert ledger_with("prv", (1.5, 0.04, 2250)).epsilon() < ledger_with("rdp", (1.5, 0.04, 2250)).epsilon()
    one = ledger_with("prv", (1.5, 0.04, 1)).epsilon()
    assert 0 < one < ledger_with("rdp", (1.5, 0.04, 1)).epsilon()
    full = ledger_with("prv", (1.0, 1.0, 5)).epsilon()  # client-level DP, every cluster every round
    assert math.isfinite(full) and full > 0


def test_empty_ledger_spends_nothing():
    for accountant in ("rdp", "prv"):
        ledger = PrivacyLedger(accountant=accountant, delta=1e-5)
        assert ledger.epsilon() == 0.0 and ledger.steps_total == 0 and ledger.history == []


# -- composition ---------------------------------------------------------------------------------
def test_rdp_k_records_of_t_steps_equal_one_record_of_kt_steps():
    chunks = ledger_with("rdp", *[(1.5, 0.04, 150)] * 15)
    assert chunks.history == [(1.5, 0.04, 2250)]  # merged the way Opacus merges consecutive steps
    assert chunks.epsilon() == ledger_with("rdp", (1.5, 0.04, 2250)).epsilon()
    assert chunks.epsilon() == pytest.approx(7.32911, abs=1e-4)


def test_prv_of_chunks_agrees_with_opacus_on_the_unmerged_history():
    from opacus.accountants import PRVAccountant

    chunks = ledger_with("prv", *[(1.5, 0.04, 750)] * 3)
    opacus = PRVAccountant()
    opacus.history = [(1.5, 0.04, 750)] * 3  # three separate entries, composed by convolution
    assert abs(chunks.epsilon() - ledger_with("prv", (1.5, 0.04, 2250)).epsilon()) <= EPS_ERROR
    assert abs(chunks.epsilon() - opacus.get_epsilon(delta=1e-5)) <= EPS_ERROR


def test_mixed_histories_compose_in_any_order():
    a = ledger_with("rdp", (1.5, 0.04, 1000), (1.2, 0.04, 500), (1.5, 0.04, 250))
    b = ledger_with("rdp", (1.2, 0.04, 500), (1.5, 0.04, 1250))
    assert len(a.history) == 3 and a.steps_total == b.steps_total == 1750
    assert a.epsilon() == pytest.approx(b.epsilon(), rel=1e-12)
    only_15 = ledger_with("rdp", (1.5, 0.04, 1750)).epsilon()
    only_12 = ledger_with("rdp", (1.2, 0.04, 1750)).epsilon()
    assert only_15 < a.epsilon() < only_12
    prv = ledger_with("prv", (1.5, 0.04, 1000), (1.2, 0.04, 500), (1.5, 0.04, 250)).epsilon()
    assert ledger_with("prv", (1.5, 0.04, 1750)).epsilon() < prv < a.epsilon()


def test_epsilon_after_does_not_record_and_matches_recording():
    ledger = ledger_with("rdp", (1.5, 0.04, 1000))
    before = ledger.epsilon()
    after = ledger.epsilon_after(noise_multiplier=1.2, sample_rate=0.04, steps=300)
    assert ledger.steps_total == 1000 and ledger.epsilon() == before
    ledger.record(noise_multiplier=1.2, sample_rate=0.04, steps=300)
    assert ledger.epsilon() == pytest.approx(after, rel=1e-12)
    assert ledger.epsilon_after(noise_multiplier=1.2, sample_rate=0.04, steps=0) == ledger.epsilon()


# -- monotonicity (RDP: fast and exact) ------------------------------------------------------------
FEW = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
qs = st.floats(0.002, 0.1)
sigmas = st.floats(0.8, 4.0)
steps = st.integers(1, 3000)


@FEW
@given(q=qs, sigma=sigmas, n=steps, more=st.integers(1, 3000))
def test_epsilon_grows_with_steps(q, sigma, n, more):
    ledger = ledger_with("rdp", (sigma, q, n))
    assert ledger.epsilon_after(noise_multiplier=sigma, sample_rate=q, steps=more) >= ledger.epsilon() - 1e-12


@FEW
@given(q=qs, factor=st.floats(1.05, 3.0), sigma=sigmas, n=steps)
def test_epsilon_grows_with_the_sample_rate(q, factor, sigma, n):
    low = epsilon_of([(sigma, q, n)], accountant="rdp", delta=1e-5)
    high = epsilon_of([(sigma, min(1.0, q * factor), n)], accountant="rdp", delta=1e-5)
    assert high >= low - 1e-12


@FEW
@given(q=qs, sigma=sigmas, factor=st.floats(1.05, 3.0), n=steps)
def test_epsilon_falls_with_the_noise(q, sigma, factor, n):
    noisy = epsilon_of([(sigma * factor, q, n)], accountant="rdp", delta=1e-5)
    assert noisy <= epsilon_of([(sigma, q, n)], accountant="rdp", delta=1e-5) + 1e-12


def test_prv_is_monotone_on_hand_picked_cases():
    base = epsilon_of([(1.5, 0.04, 500)], accountant="prv", delta=1e-5)
    assert epsilon_of([(1.5, 0.04, 1000)], accountant="prv", delta=1e-5) > base
    assert epsilon_of([(1.5, 0.08, 500)], accountant="prv", delta=1e-5) > base
    assert epsilon_of([(3.0, 0.04, 500)], accountant="prv", delta=1e-5) < base


# -- state ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("accountant", ["rdp", "prv"])
def test_state_round_trips_through_json_and_continues_identically(accountant):
    ledger = ledger_with(accountant, (1.5, 0.04, 100), (1.3, 0.05, 40))
    state = json.loads(json.dumps(ledger.state_dict()))
    restored = PrivacyLedger.from_state(state)
    assert restored.history == ledger.history and restored.epsilon() == ledger.epsilon()
    same = PrivacyLedger(accountant=accountant, delta=1e-5)
    same.load_state_dict(state)
    for each in (ledger, restored, same):
        each.record(noise_multiplier=1.3, sample_rate=0.05, steps=60)
    assert restored.state_dict() == ledger.state_dict() == same.state_dict()
    assert restored.history[-1] == (1.3, 0.05, 100)
    assert restored.epsilon() == ledger.epsilon() == same.epsilon()
    assert restored.describe() == ledger.describe()
    assert set(ledger.describe()) >= {"epsilon", "delta", "accountant", "steps"}


def test_load_refuses_mismatched_or_malformed_state():
    state = ledger_with("rdp", (1.5, 0.04, 10)).state_dict()
    with pytest.raises(ValueError, match="accountant"):
        PrivacyLedger(accountant="prv", delta=1e-5).load_state_dict(state)
    with pytest.raises(ValueError, match="δ"):
        PrivacyLedger(accountant="rdp", delta=1e-6).load_state_dict(state)
    for bad in ({**state, "history": [[1.5, 0.04]]}, {**state, "history": [[0.0, 0.04, 3]]},
                {**state, "history": [[1.5, 1.5, 3]]}, {**state, "history": [[1.5, 0.04, 2.5]]},
                {**state, "format": 99}, {"accountant": "rdp"}, None):
        with pytest.raises(ValueError):
            PrivacyLedger(accountant="rdp", delta=1e-5).load_state_dict(bad)
    ledger = PrivacyLedger(accountant="rdp", delta=1e-5)
    ledger.load_state_dict({**state, "history": [[1.5, 0.04, 10.0]]})  # JSON may turn ints into floats
    assert ledger.history == [(1.5, 0.04, 10)]


def test_bad_arguments_are_refused_in_one_sentence():
    with pytest.raises(ConfigError, match="accountant 'gdp' is unknown"):
        PrivacyLedger(accountant="gdp", delta=1e-5)
    with pytest.raises(ConfigError, match="delta"):
        PrivacyLedger(accountant="rdp", delta=0)
    ledger = PrivacyLedger(accountant="rdp", delta=1e-5)
    for kwargs in ({"noise_multiplier": 0.0, "sample_rate": 0.1, "steps": 1},
                   {"noise_multiplier": 1.0, "sample_rate": 0.0, "steps": 1},
                   {"noise_multiplier": 1.0, "sample_rate": 0.1, "steps": -1},
                   {"noise_multiplier": 1.0, "sample_rate": 0.1, "steps": 1.5}):
        with pytest.raises(ValueError):
            ledger.record(**kwargs)
    assert ledger.steps_total == 0


def test_numpy_scalars_are_accepted_and_stored_as_plain_numbers():
    import numpy as np

    ledger = PrivacyLedger(accountant="rdp", delta=1e-5)
    ledger.record(noise_multiplier=np.float64(1.5), sample_rate=np.float64(0.04), steps=np.int64(2250))
    state = ledger.state_dict()
    assert json.loads(json.dumps(state)) == state and type(state["history"][0][2]) is int
    assert ledger.epsilon() == pytest.approx(7.32911, abs=1e-4)
