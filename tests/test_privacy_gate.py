"""Rank 0's gate with a real ledger: the default budget stops a floor-only policy, and the server's plan moves
no floor. References are Opacus's own accountant and σ search, called here independently of the gate."""

import pytest
from opacus.accountants import RDPAccountant
from opacus.accountants.utils import get_noise_multiplier

from nebula_fl.clients.privacy_gate import PrivacyGate
from nebula_fl.privacy.cluster_ledger import ClusterLedger
from nebula_fl.privacy.policy import DEFAULT_MAX_EPSILON, PrivacyPolicy

N = 1000


def gate(tmp_path, **policy):
    return PrivacyGate(policy=PrivacyPolicy(accountant="rdp", delta=1e-5, **policy),
                       ledger=ClusterLedger(path=tmp_path / "ledger.jsonl", accountant="rdp"), num_examples=N)


def releases_within(budget, *, sigma, q, steps, delta=1e-5):
    """Independent reference: how many rounds of `steps` Gaussian releases at rate q fit in ε ≤ budget (Opacus RDP)."""
    accountant, rounds = RDPAccountant(), 0
    while True:
        for _ in range(steps):
            accountant.step(noise_multiplier=sigma, sample_rate=q)
        if accountant.get_epsilon(delta=delta) > budget:
            return rounds
        rounds += 1


@pytest.mark.parametrize("mode, asked", [
    ("client", {"privacy-sigma": 1.0, "privacy-noise-shares": 1}),
    ("sample", {"privacy.batch-size": N, "local-steps": 1}),  # the server asks q = 1, one step a round
])
def test_a_floor_only_policy_stops_when_the_default_budget_is_spent(tmp_path, mode, asked):
    cluster = gate(tmp_path, mode=mode, min_noise_multiplier=1.0)
    config = {"privacy.mode": mode, "privacy.noise-multiplier": 1.0, "num-server-rounds": 1000, **asked}
    expected = releases_within(DEFAULT_MAX_EPSILON, sigma=1.0, q=1.0, steps=1)
    assert expected == 3  # RDP: 9.01 after three, 10.7 after four
    for rnd in range(1, 100):
        admission = cluster.admit({**config, "server-round": rnd}, world=1)
        if not admission.allowed:
            break
        assert (admission.sample_rate, admission.steps, admission.budget) == (1.0, 1, DEFAULT_MAX_EPSILON)
        cluster.charge(federation="f", server_round=rnd, admission=admission)
    assert rnd - 1 == expected and admission.refusal == "budget"
    assert "cluster budget ε ≤ 10 would be exceeded" in admission.reason


PLAN = {"planned_rounds": 10, "planned_local_steps": 5, "planned_batch_size": 100}  # q = 0.1, 50 steps


@pytest.mark.parametrize("rounds, local_steps, batch", [
    (10, 5, 100),  # the operator's plan
    (1, 1, 10),  # a short plan at a small batch: the request's own derivation would lower the floor
    (100, 20, 500),  # a long one at a large batch: it would raise it
])
def test_the_floor_is_the_operators_plan_whatever_the_server_asks(tmp_path, rounds, local_steps, batch):
    cluster = gate(tmp_path, mode="sample", target_epsilon=4.0, max_epsilon=1000.0, **PLAN)
    floor = get_noise_multiplier(target_epsilon=4.0, target_delta=1e-5, sample_rate=0.1, steps=50,
                                 accountant="rdp", epsilon_tolerance=0.01)
    request = {"privacy.mode": "sample", "num-server-rounds": rounds, "local-steps": local_steps,
               "privacy.batch-size": batch, "batch-size": 8}
    at = cluster.admit({**request, "privacy.noise-multiplier": floor}, world=1)
    assert at.allowed and at.noise_multiplier == floor and at.steps == local_steps
    assert at.sample_rate == 1 / -(-N // batch)  # the release itself is accounted at the rate it runs at
    below = cluster.admit({**request, "privacy.noise-multiplier": floor * (1 - 1e-6)}, world=1)
    assert not below.allowed and below.refusal == "policy" and f"floor σ ≥ {floor:.4g}" in below.reason
    # a request by target ε over the server's own plan is judged against the same floor
    target = cluster.admit({**request, "privacy.target-epsilon": 4.0}, world=1)
    assert target.allowed == (rounds * local_steps >= 50 and batch >= 100)


@pytest.mark.parametrize("secure", [False, True])
def test_a_cluster_with_no_policy_says_it_ran_the_servers_dp_with_no_budget(tmp_path, secure):
    from nebula_fl.clients.outgoing import released
    from nebula_fl.clients.protocol import pack, split

    request = {"privacy.mode": "sample", "privacy.noise-multiplier": 0.3, "privacy.batch-size": N, "local-steps": 2,
               "num-server-rounds": 1000, "server-round": 1}
    for policy, flagged in (({}, True), ({"mode": "sample", "min_noise_multiplier": 0.3, "max_epsilon": 1e4}, False)):
        cluster = gate(tmp_path / str(flagged), **policy)
        admission = cluster.admit(request, world=1)
        assert admission.allowed and (admission.budget is None) == flagged  # no cap at all, only the request's
        cluster.charge(federation="f", server_round=1, admission=admission)
        assert cluster.ledger.entries()[0].get("no_budget", False) is flagged
        metrics = cluster.metrics(admission, federation="f")
        # the flag is the operator's setting, not the data's: it passes secure aggregation's filter on purpose
        sent = split(released(pack({"ok": True, "metrics": metrics}), secure=secure))[0]["metrics"]
        assert sent.get("privacy-no-budget") == (1 if flagged else None)
        assert ("epsilon" in sent) is not secure  # (per-example figures stay in the cluster under masking)
