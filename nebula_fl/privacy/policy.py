"""A cluster's own privacy policy, and the pure rule that admits or refuses what the server asks.

The operator of a cluster owns its data and its privacy policy; the server only *asks*. The policy
is given to the trainer at start (``nebula-fl trainer --privacy-policy FILE`` or flags) and never
comes over the network. A round's request may ask for more privacy than the policy, never less:

- mode: a policy of ``sample`` or ``client`` admits only a request of the same mode (a request of
  ``off`` or of the other mode is refused); a policy of ``off`` admits any request;
- noise: the request's noise multiplier (given, or derived from its target ε) must be at least the
  policy's floor (given, or derived from the policy's target ε over the same planned steps);
- δ and budget: an explicit request δ above the policy's, or a budget (max ε) above the policy's, is
  refused; otherwise the tighter of the two applies;
- clipping norm: the policy's when it sets one (ε does not depend on it; it is the operator's call).

In ``client`` mode what leaves the cluster each round is one Gaussian release of the clipped update
with noise std ``sigma·C/√shares``: its own noise multiplier is ``sigma/√shares``, which must clear the
floor, and the cluster accounts it without any sampling amplification (q = 1): who is sampled is the
server's decision, so amplification by sampling is not a guarantee the cluster can rely on.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from nebula_fl.errors import ConfigError

POLICY_FILE = "privacy-policy.json"  # the policy in force, copied into the trainer's state folder at start
MODES = ("off", "sample", "client")
ACCOUNTANTS = ("prv", "rdp")
DEFAULT_DELTA = 1e-5
MAX_NOISE_MULTIPLIER = 1e6


def _finite_positive(name: str, value: float | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"privacy policy '{name}' is {value!r}; use a finite number > 0")


@dataclass(kw_only=True, frozen=True)
class PrivacyPolicy:
    """What this cluster's operator allows to leave it, whatever the server asks."""

    mode: str = "off"
    """'off' (no requirement: any request is admitted), 'sample' (DP-SGD per example) or 'client' (the update)."""
    min_noise_multiplier: float | None = None
    """The lowest noise multiplier σ this cluster trains with; or set `target_epsilon` instead."""
    target_epsilon: float | None = None
    """The ε the planned run should end at: the σ floor is derived from it over the run's planned steps."""
    max_epsilon: float | None = None
    """Lifetime budget of this cluster's data (all federations together); defaults to `target_epsilon`."""
    delta: float | None = None
    """δ; default min(1e-5, 1/(10 n)) for n examples ('sample'), 1e-5 for the whole data set ('client')."""
    max_grad_norm: float | None = None
    """Clipping norm (per example or per update); None takes the round's."""
    accountant: str = "prv"
    """'prv' or 'rdp': how this cluster composes its own releases."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"privacy policy 'mode' is {self.mode!r}; use one of {', '.join(MODES)}")
        if self.accountant not in ACCOUNTANTS:
            raise ConfigError(f"privacy policy 'accountant' is {self.accountant!r}; use prv or rdp")
        for name in ("min_noise_multiplier", "target_epsilon", "max_epsilon", "max_grad_norm"):
            _finite_positive(name, getattr(self, name))
        if self.min_noise_multiplier is not None and self.min_noise_multiplier > MAX_NOISE_MULTIPLIER:
            raise ConfigError(f"privacy policy 'min_noise_multiplier' is {self.min_noise_multiplier}; use at most 1e6")
        if self.delta is not None and (isinstance(self.delta, bool) or not isinstance(self.delta, int | float)
                                       or not 0 < self.delta < 1):
            raise ConfigError(f"privacy policy 'delta' is {self.delta!r}; use a number in (0, 1), such as 1e-5")
        if self.mode != "off" and (self.min_noise_multiplier is None) == (self.target_epsilon is None):
            raise ConfigError(
                f"privacy policy of mode '{self.mode}' needs exactly one of min_noise_multiplier (σ > 0) and "
                "target_epsilon; set one of them"
            )

    @property
    def budget(self) -> float | None:
        return self.max_epsilon if self.max_epsilon is not None else self.target_epsilon

    def resolved_delta(self, num_examples: int) -> float:
        """δ in force: the operator's, or the default; never as large as 1/n for per-example DP."""
        if self.delta is not None:
            return float(self.delta)
        if self.mode == "sample":
            return min(DEFAULT_DELTA, 1.0 / (10 * max(1, num_examples)))
        return DEFAULT_DELTA

    def check_for(self, num_examples: int) -> None:
        """Refuse a δ that could expose a whole record outright: δ must stay below 1/n ('sample')."""
        if self.mode == "sample" and self.delta is not None and self.delta >= 1.0 / max(1, num_examples):
            raise ConfigError(
                f"privacy policy δ = {self.delta:g} is not below 1/n = {1.0 / num_examples:g} for this cluster's "
                f"{num_examples} examples; use a δ well below that, e.g. {min(DEFAULT_DELTA, 0.1 / num_examples):.1g}"
            )

    # -- persistence -----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, data: Any, *, where: str = "privacy policy") -> PrivacyPolicy:
        if not isinstance(data, dict):
            raise ConfigError(f"{where} must be a JSON object of policy fields, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"{where} has unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**data)

    @classmethod
    def load(cls, path: str | Path) -> PrivacyPolicy:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except OSError as err:
            raise ConfigError(f"cannot read the privacy policy '{path}' ({err.strerror}); pass an existing JSON file") from None
        except ValueError as err:
            raise ConfigError(f"privacy policy '{path}' is not valid JSON ({err}); fix the file") from None
        return cls.from_dict(data, where=f"privacy policy '{path}'")

    def save(self, path: str | Path) -> None:
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        tmp.replace(path)


def policy_for_run(asked: Any) -> PrivacyPolicy:
    """The policy a cluster operator who wants exactly what a run config asks would write (the launcher's).

    `asked` is a ``PrivacyConfig``: its mode, noise multiplier (as the floor) or target ε, budget, δ,
    clipping norm and accountant become the policy; nothing weaker can then be asked of the cluster.
    """
    if asked.mode == "off":
        return PrivacyPolicy(accountant=asked.accountant)
    return PrivacyPolicy(mode=asked.mode, min_noise_multiplier=asked.noise_multiplier,
                         target_epsilon=asked.target_epsilon, max_epsilon=asked.max_epsilon, delta=asked.delta,
                         max_grad_norm=asked.max_grad_norm, accountant=asked.accountant)


@dataclass(kw_only=True, frozen=True)
class PrivacyRequest:
    """What the server's round config asks for (already type-checked by PrivacyConfig)."""

    mode: str
    noise_multiplier: float | None = None  # sample mode: σ, or None to derive it from target_epsilon
    target_epsilon: float | None = None
    max_epsilon: float | None = None
    delta: float | None = None
    max_grad_norm: float = 1.0
    client_sigma: float | None = None  # client mode: the server's σ for the sum
    noise_shares: int = 1  # client mode: into how many shares the noise of the sum is split
    secure_threshold: int | None = None  # the round is securely aggregated: at least this many uploads are summed


@dataclass(kw_only=True, frozen=True)
class Admission:
    """The policy's verdict on a request: refused (with a reason), or the exact mechanism to run."""

    allowed: bool
    reason: str = ""
    refusal: str = ""  # why not: "policy" (the request is weaker than the policy) or "budget" (spent)
    mode: str = "off"
    noise_multiplier: float | None = None  # σ of each release this cluster makes (per step, or per update)
    sample_rate: float = 1.0  # q the cluster accounts each release with
    steps: int = 0  # releases this round (DP-SGD steps, or 1 update)
    max_grad_norm: float | None = None
    delta: float | None = None  # the policy's δ (the ledger's)
    budget: float | None = None  # max ε at `delta`
    request_delta: float | None = None  # a stricter δ the server asked for, with its own budget
    request_budget: float | None = None
    noise_shares: int = 1  # client mode: this cluster adds 1/noise_shares of the variance of noise_multiplier


def refuse(reason: str) -> Admission:
    return Admission(allowed=False, reason=reason, refusal="policy")


def admit(
    policy: PrivacyPolicy, request: PrivacyRequest, *, num_examples: int, sample_rate: float, steps: int,
    planned_steps: int, derive_sigma,
) -> Admission:
    """Decide whether this cluster runs the requested round, and with which mechanism.

    `sample_rate` and `steps` describe one round of per-example DP-SGD (q = expected batch / n);
    `planned_steps` is the run's planned number of such steps (rounds × local steps), or of rounds
    in client mode; `derive_sigma(target_epsilon, delta, sample_rate, steps)` is the σ that spends a
    target ε (``privacy.budget.noise_for_target`` with the policy's accountant).
    """
    delta = policy.resolved_delta(num_examples)
    if policy.mode != "off" and request.mode != policy.mode:
        return refuse(f"the server asks privacy.mode='{request.mode}'; this cluster's policy requires "
                      f"'{policy.mode}' (set privacy.mode=\"{policy.mode}\" on the server)")
    if request.mode == "off":
        return Admission(allowed=True, mode="off")
    if request.delta is not None and request.delta > delta * (1 + 1e-12):
        return refuse(f"the server asks δ = {request.delta:g}, weaker than this cluster's δ = {delta:g}")
    if request.max_epsilon is not None and policy.budget is not None and request.max_epsilon > policy.budget * (1 + 1e-12):
        return refuse(f"the server asks a budget of ε ≤ {request.max_epsilon:g}, more than this cluster's "
                      f"ε ≤ {policy.budget:g}")
    client = request.mode == "client"
    shares = 1  # into how many shares this cluster's noise is split (client mode under secure aggregation)
    q, k = (1.0, 1) if client else (sample_rate, steps)
    # the σ the request implies for what leaves this cluster
    if client:
        if request.client_sigma is None or not request.client_sigma > 0:
            return refuse(f"the server asks client-level DP with noise multiplier {request.client_sigma!r}; it must be > 0")
        if request.noise_shares < 1:
            return refuse(f"the server asks the noise split into {request.noise_shares} shares; it must be 1 or more")
        if request.secure_threshold is not None and request.noise_shares <= request.secure_threshold:
            # only sums of at least `secure_threshold` masked updates are ever unmasked, each carrying its
            # share of the noise: what the server sees carries the full σ
            asked, shares = request.client_sigma, request.noise_shares
        else:  # seen on its own, this cluster's update carries only its share of the noise
            asked = request.client_sigma / math.sqrt(request.noise_shares)
    elif request.noise_multiplier is not None:
        asked = request.noise_multiplier
    else:
        asked = derive_sigma(request.target_epsilon, request.delta if request.delta is not None else delta, q,
                             planned_steps)
    floor = policy.min_noise_multiplier
    if floor is None and policy.target_epsilon is not None:
        floor = derive_sigma(policy.target_epsilon, delta, q, planned_steps)
    if floor is not None and asked < floor * (1 - 1e-9):
        what = "σ" if not client or shares > 1 else f"σ/√shares = {request.client_sigma:g}/√{request.noise_shares}"
        return refuse(f"the server asks {what} = {asked:.4g}, below this cluster's floor σ ≥ {floor:.4g}")
    if not math.isfinite(asked) or asked <= 0:
        return refuse(f"the server's request implies noise multiplier {asked!r}; DP needs a finite σ > 0")
    stricter = request.delta is not None and request.delta < delta
    # a request at the policy's δ may tighten the budget there; one at a smaller δ is checked at its own δ
    budgets = [b for b in (policy.budget, None if stricter else request.max_epsilon) if b is not None]
    return Admission(
        allowed=True, mode=request.mode, noise_multiplier=float(asked), sample_rate=float(q), steps=int(k),
        max_grad_norm=policy.max_grad_norm if policy.max_grad_norm is not None else request.max_grad_norm,
        delta=delta, budget=min(budgets) if budgets else None,
        request_delta=request.delta if stricter else None,
        request_budget=request.max_epsilon if stricter else None,
        noise_shares=shares,
    )
