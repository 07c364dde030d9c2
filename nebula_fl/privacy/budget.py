"""A cluster's privacy budget: how many more DP steps fit, which σ reaches a target ε, and the round verdict.

Pure functions over a ``PrivacyLedger`` (which they only read). A cluster with budget ``max-epsilon``
runs a round only if the ledger's ε *after* the round's steps stays ≤ ``max-epsilon``; otherwise it
refuses the round whole (``decide_round``) or, if the caller prefers, runs the ``steps_within_budget``
steps that still fit.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from numbers import Real
from typing import Any

from nebula_fl.errors import ConfigError
from nebula_fl.privacy.ledger import DEFAULT_EPS_ERROR, PrivacyLedger, check_accountant, check_delta, check_mechanism


def default_delta(num_examples: int) -> float:
    """δ = 1 / (10 n): well below 1/n, so no single record is likely to be exposed outright."""
    if isinstance(num_examples, bool) or not isinstance(num_examples, int) or num_examples < 1:
        raise ConfigError(f"default delta needs the number of training examples (an integer ≥ 1), got {num_examples!r}")
    return 1.0 / (10 * num_examples)


def check_budget(max_epsilon: Any) -> float:
    if isinstance(max_epsilon, bool) or not isinstance(max_epsilon, Real) or math.isnan(max_epsilon) \
            or max_epsilon <= 0:
        raise ConfigError(f"max-epsilon is {max_epsilon!r}; pass a privacy budget ε > 0 (inf for no budget)")
    return float(max_epsilon)


def steps_within_budget(
    *, ledger: PrivacyLedger, max_epsilon: float, noise_multiplier: float, sample_rate: float, max_steps: int
) -> int:
    """The largest k ≤ ``max_steps`` with ``ledger.epsilon_after(k) ≤ max_epsilon``; 0 if even one step breaks it.

    Binary search over k (ε grows with k), so ~log2(max_steps) accountant calls; the common case,
    all ``max_steps`` fitting, costs one.
    """
    budget = check_budget(max_epsilon)
    check_mechanism(noise_multiplier=noise_multiplier, sample_rate=sample_rate, steps=max_steps)

    def fits(k: int) -> bool:
        return ledger.epsilon_after(noise_multiplier=noise_multiplier, sample_rate=sample_rate, steps=k) <= budget

    if max_steps == 0 or fits(max_steps):
        return int(max_steps)
    if not fits(1):
        return 0
    low, high = 1, int(max_steps)  # fits(low), not fits(high)
    while high - low > 1:
        mid = (low + high) // 2
        if fits(mid):
            low = mid
        else:
            high = mid
    return low


def noise_for_target(
    *, target_epsilon: float, delta: float, sample_rate: float, steps: int, accountant: str = "prv",
    epsilon_tolerance: float = 0.01,
) -> float:
    """The σ that spends ``target_epsilon`` (within ``epsilon_tolerance`` below it) over ``steps`` steps at rate q.

    Opacus's ``get_noise_multiplier`` (binary search on σ); ε at the σ returned is ≤ target.
    """
    check_budget(target_epsilon)
    check_accountant(accountant)
    check_delta(delta)
    check_mechanism(noise_multiplier=1.0, sample_rate=sample_rate, steps=steps)
    if steps < 1:
        raise ConfigError(f"noise_for_target needs at least one step, got {steps!r}")
    from opacus.accountants.utils import get_noise_multiplier

    unreachable = ConfigError(
        f"target ε = {target_epsilon:g} at δ = {delta:g} is unreachable over {steps} steps at sample rate "
        f"{sample_rate:g} with the {accountant} accountant, even with noise multiplier 1e6 (its floor is "
        f"{epsilon_floor(delta=delta, accountant=accountant):.3g}); raise the target epsilon or lower the steps or sample rate"
    )
    if target_epsilon <= epsilon_floor(delta=delta, accountant=accountant):
        raise unreachable  # Opacus would double σ up to 1e6 first (tens of seconds) to find out
    kwargs: dict[str, Any] = {"eps_error": DEFAULT_EPS_ERROR} if accountant == "prv" else {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
        try:
            return float(get_noise_multiplier(target_epsilon=target_epsilon, target_delta=delta,
                                              sample_rate=sample_rate, steps=steps, accountant=accountant,
                                              epsilon_tolerance=epsilon_tolerance, **kwargs))
        except ValueError:
            raise unreachable from None


def epsilon_floor(*, delta: float, accountant: str) -> float:
    """The ε an accountant reports for a mechanism that leaks nothing: no σ reaches a target at or below it.

    RDP: Opacus's RDP → (ε, δ) conversion at zero Rényi divergence over its default orders (~0.1 at
    δ = 1e-5); PRV: its ``eps_error``, added to every estimate.
    """
    check_delta(delta)
    if check_accountant(accountant) == "prv":
        return DEFAULT_EPS_ERROR
    from opacus.accountants import RDPAccountant
    from opacus.accountants.analysis.rdp import get_privacy_spent

    orders = RDPAccountant.DEFAULT_ALPHAS
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
        eps, _ = get_privacy_spent(orders=orders, rdp=[0.0] * len(orders), delta=delta)
    return float(eps)


def _show(eps: float, budget: float) -> str:
    """ε to 2 decimals, or as many more (up to 6) as it takes not to print a refused 8.004 as the budget 8.00."""
    for digits in range(2, 7):
        if eps == budget or round(eps, digits) != round(budget, digits):
            break
    return f"{eps:.{digits}f}"


@dataclass(frozen=True)
class BudgetDecision:
    """Whether a round may run: ε now, ε if it runs, and a sentence saying why."""

    allowed: bool
    epsilon_now: float
    epsilon_after: float
    reason: str


def decide_round(
    *, ledger: PrivacyLedger, max_epsilon: float, noise_multiplier: float, sample_rate: float, steps: int
) -> BudgetDecision:
    """Allow the round's ``steps`` only if ε after them stays ≤ ``max_epsilon``."""
    after = ledger.epsilon_after(noise_multiplier=noise_multiplier, sample_rate=sample_rate, steps=steps)
    return verdict(epsilon_now=ledger.epsilon(), epsilon_after=after, max_epsilon=max_epsilon, steps=steps)


def verdict(*, epsilon_now: float, epsilon_after: float, max_epsilon: float, steps: int, what: str = "cluster budget",
            delta: float | None = None) -> BudgetDecision:
    """The decision for a round that takes ε from `epsilon_now` to `epsilon_after` against a budget."""
    budget = check_budget(max_epsilon)
    allowed = epsilon_after <= budget
    verb = "is kept" if allowed else "would be exceeded"
    at = "" if delta is None else f" at δ = {delta:g}"
    reason = (f"{what} ε ≤ {budget:g}{at} {verb}: {_show(epsilon_now, budget)} now, "
              f"{_show(epsilon_after, budget)} after {steps} more steps")
    return BudgetDecision(allowed=allowed, epsilon_now=epsilon_now, epsilon_after=epsilon_after, reason=reason)
