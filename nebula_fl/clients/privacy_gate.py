"""Rank 0's gate between the server's request and anything leaving the cluster.

Before a round is trained, the gate reads the request's privacy keys, asks the operator's policy
(``privacy/policy.py``) whether to admit it, and checks the cluster's lifetime budget against its
own append-only ledger; after training and before the reply leaves, it records the release.
Nothing in here takes the server's word for what the policy is.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from nebula_fl.config import PrivacyConfig, TrainConfig
from nebula_fl.errors import ConfigError
from nebula_fl.privacy.budget import noise_for_target, verdict
from nebula_fl.privacy.cluster_ledger import ClusterLedger
from nebula_fl.privacy.dp_recipe import logical_batch
from nebula_fl.privacy.policy import Admission, PrivacyPolicy, PrivacyRequest, admit, refuse, sample_rate_for


@lru_cache(maxsize=64)
def _sigma_for(target_epsilon: float, delta: float, sample_rate: float, steps: int, accountant: str) -> float:
    return noise_for_target(target_epsilon=target_epsilon, delta=delta, sample_rate=sample_rate, steps=steps,
                            accountant=accountant)


class PrivacyGate:
    def __init__(self, *, policy: PrivacyPolicy, ledger: ClusterLedger, num_examples: int) -> None:
        policy.check_for(num_examples)
        self.policy, self.ledger, self.num_examples = policy, ledger, num_examples

    def admit(self, config: dict[str, Any], *, world: int, secure_threshold: int | None = None) -> Admission:
        """The policy's and the budget's verdict on a round's config (`secure_threshold`: the round's uploads are
        masked by this cluster's secure-aggregation stage and unmasked only in sums of at least that many)."""
        try:
            asked = PrivacyConfig.from_flat(config)
            train = TrainConfig.from_flat(config)
            rounds = int(config.get("num-server-rounds", 1))
            request = PrivacyRequest(
                mode=asked.mode, noise_multiplier=asked.noise_multiplier, target_epsilon=asked.target_epsilon,
                max_epsilon=asked.max_epsilon, delta=asked.delta, max_grad_norm=asked.max_grad_norm,
                client_sigma=float(config["privacy-sigma"]) if "privacy-sigma" in config else None,
                noise_shares=int(config.get("privacy-noise-shares", 1)), secure_threshold=secure_threshold,
            )
        except (ConfigError, TypeError, ValueError, OverflowError) as err:
            return refuse(f"the round's privacy request is malformed: {err}")
        q = sample_rate_for(self.num_examples, logical_batch=logical_batch(
            requested=asked.batch_size, num_examples=self.num_examples, batch_size=train.batch_size, world=world,
            private=asked.mode == "sample"))
        planned = max(1, rounds) * (1 if asked.mode == "client" else train.steps_cap)
        accountant = self.policy.accountant

        def derive(target: float, delta: float, rate: float, steps: int) -> float:
            return _sigma_for(float(target), float(delta), float(rate), int(steps), accountant)

        try:
            admission = admit(self.policy, request, num_examples=self.num_examples, sample_rate=q,
                              steps=train.steps_cap, planned_steps=planned, derive_sigma=derive)
        except ConfigError as err:  # e.g. a target ε no σ can reach
            return refuse(str(err))
        if not admission.allowed or admission.mode == "off":
            return admission
        checks = [(admission.delta, admission.budget, "cluster budget")]
        if admission.request_delta is not None and admission.request_budget is not None:
            checks.append((admission.request_delta, admission.request_budget, "requested budget"))
        for delta, budget, what in checks:
            if budget is None:
                continue
            mode = admission.mode
            decision = verdict(
                epsilon_now=self.ledger.epsilon(mode=mode, delta=delta),
                epsilon_after=self.ledger.epsilon_after(mode=mode, delta=delta, noise_multiplier=admission.noise_multiplier,
                                                        sample_rate=admission.sample_rate, steps=admission.steps),
                max_epsilon=budget, steps=admission.steps, what=what,
                delta=None if delta == admission.delta else delta,
            )
            if not decision.allowed:
                return Admission(allowed=False, reason=decision.reason, refusal="budget", mode=mode, budget=budget,
                                 delta=admission.delta)
        return admission

    def charge(self, *, federation: str, server_round: int, admission: Admission) -> None:
        """Record the round's release; call after training, before the reply leaves."""
        if admission.mode == "off":
            return
        self.ledger.record(federation=federation, round=server_round, mode=admission.mode,
                           noise_multiplier=admission.noise_multiplier, sample_rate=admission.sample_rate,
                           steps=admission.steps, delta=admission.delta, no_budget=self.no_budget)

    @property
    def no_budget(self) -> bool:
        """The operator set no policy (mode 'off'): the cluster runs whatever DP the server asks, with no ε cap of
        its own (only a budget the request itself sets)."""
        return self.policy.budget is None

    def metrics(self, admission: Admission, *, federation: str) -> dict[str, Any]:
        """What the round's reply says about this cluster's privacy (cumulative over its whole life)."""
        mode = admission.mode if admission.mode in ("sample", "client") else self.policy.mode
        if mode not in ("sample", "client"):
            return {}
        delta = admission.delta if admission.delta is not None else self.policy.resolved_delta(self.num_examples)
        out: dict[str, Any] = {
            "epsilon": self.ledger.epsilon(mode=mode, delta=delta),
            "epsilon-federation": self.ledger.epsilon(mode=mode, delta=delta, federation=federation),
            "delta": delta, "dp-steps": self.ledger.steps(mode=mode), "accountant": self.ledger.accountant,
            "privacy-mode": mode,
        }
        if admission.noise_multiplier is not None:
            out.update({"noise-multiplier": admission.noise_multiplier, "sample-rate": admission.sample_rate})
        if admission.max_grad_norm is not None:
            out["max-grad-norm"] = admission.max_grad_norm
        if admission.budget is not None:
            out["max-epsilon"] = admission.budget
        if self.no_budget:  # a setting of the operator's, never of the data: said under secure aggregation too
            out["privacy-no-budget"] = 1
        return out

    def refusal(self, admission: Admission, *, federation: str, cluster_id: int) -> dict[str, Any]:
        """The reply metrics of a refused round: who, why, and what is spent (nothing more was); not its size."""
        return {"cluster-id": cluster_id, "privacy-refused": 1,
                "privacy-reason": admission.reason, "privacy-refusal": admission.refusal,
                **self.metrics(admission, federation=federation)}
