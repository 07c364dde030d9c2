"""A cluster's own privacy policy, and the pure rule that admits or refuses what the server asks.

The operator of a cluster owns its data and its privacy policy; the server only *asks*. The policy
is given to the trainer at start (``nebula-fl trainer --privacy-policy FILE`` or flags) and never
comes over the network. A round's request may ask for more privacy than the policy, never less:

- mode: a policy of ``sample`` or ``client`` admits only a request of the same mode (a request of
  ``off`` or of the other mode is refused); a policy of ``off`` admits any request;
- noise: the request's noise multiplier (given, or derived from its target ε) must be at least the
  policy's floor (given, or derived from the policy's target ε over the *operator's* planned releases
  at the operator's planned sample rate: nothing the server says about its plan moves the floor);
- δ and budget: an explicit request δ above the policy's, or a budget (max ε) above the policy's, is
  refused; otherwise the tighter of the two applies. A DP policy always has a lifetime budget: its
  ``max_epsilon``, else its ``target_epsilon``, else ``DEFAULT_MAX_EPSILON``;
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
from nebula_fl.privacy.dp_recipe import DP_BATCH_FRACTION

POLICY_FILE = "privacy-policy.json"  # the policy in force, copied into the trainer's state folder at start
MODES = ("off", "sample", "client")
ACCOUNTANTS = ("prv", "rdp")
DEFAULT_DELTA = 1e-5
MAX_NOISE_MULTIPLIER = 1e6
# A DP policy without max_epsilon still gets a lifetime budget, or the server could ask for unlimited rounds at
# q = 1: ε = 10 is the upper end of what the DP-ML literature calls reasonable (Ponomareva et al. 2023, "How to
# DP-fy ML": ε ≤ 1 strong, ε ≤ 10 reasonable, above that weak).
DEFAULT_MAX_EPSILON = 10.0
PLAN_LIMITS = {"planned_rounds": 100_000, "planned_local_steps": 1_000_000, "planned_batch_size": 1_000_000}


def _finite_positive(name: str, value: float | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"privacy policy '{name}' is {value!r}; use a finite number > 0")


def _int_in(name: str, value: int | None, *, low: int, high: int) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(f"privacy policy '{name}' is {value!r}; use a whole number from {low} to {high}")


def sample_rate_for(num_examples: int, *, logical_batch: int) -> float:
    """q of the cluster's Poisson-sampled DP-SGD: its expected logical batch over its examples (as Opacus sets it)."""
    return 1.0 / math.ceil(num_examples / logical_batch)


@dataclass(kw_only=True, frozen=True)
class PrivacyPolicy:
    """What this cluster's operator allows to leave it, whatever the server asks."""

    mode: str = "off"
    """'off' (no requirement: any request is admitted, a DP one with no ε cap, reported as "no budget"),
    'sample' (DP-SGD per example) or 'client' (the update)."""
    min_noise_multiplier: float | None = None
    """The lowest noise multiplier σ this cluster trains with; or set `target_epsilon` instead."""
    target_epsilon: float | None = None
    """The ε the operator's plan should end at: the σ floor is the σ that spends it over the `planned_*` releases
    at the planned sample rate (the server's own rounds, steps and batch do not move it); needs the plan."""
    planned_rounds: int | None = None
    """With `target_epsilon`: the rounds this cluster plans to release (its plan, not the server's
    num-server-rounds); 1 to 100,000. 'client' mode: one release per round, at q = 1."""
    planned_local_steps: int | None = None
    """With `target_epsilon`, 'sample' mode: DP-SGD steps per planned round; 1 to 1,000,000."""
    planned_batch_size: int | None = None
    """With `target_epsilon`, 'sample' mode: the planned expected logical batch of a DP-SGD step (q = 1/⌈n/batch⌉
    for this cluster's n examples); None: the DP recipe's default, an eighth of the examples."""
    max_epsilon: float | None = None
    """Lifetime budget of this cluster's data (all federations together); default `target_epsilon`, else (DP
    modes) ε ≤ 10 (`DEFAULT_MAX_EPSILON`)."""
    delta: float | None = None
    """δ; default min(1e-5, 1/(10 n)) for n examples ('sample'), 1e-5 for the whole data set ('client')."""
    max_grad_norm: float | None = None
    """Clipping norm (per example or per update); None takes the round's."""
    accountant: str = "prv"
    """'prv' or 'rdp': how this cluster composes its own releases."""
    require_secure_aggregation: bool = False
    """Train only rounds whose uploads are securely aggregated (enforced by the secure-aggregation stage)."""
    min_secagg_threshold: int | None = None
    """With the requirement: the fewest clusters whose sum the server may unmask; ≥ 2, default 2."""
    min_secagg_clusters: int | None = None
    """With the requirement: the fewest clusters masked together in a round; ≥ 2 and ≥ the threshold, default
    the threshold."""
    secagg_peers: str | None = None
    """Path of the federation's roster: the other clusters' secure-aggregation identity public keys, exchanged
    by the operators out of band (the server could otherwise count clusters of its own)."""
    secagg_trust_server_membership: bool = False
    """Without a roster, take the server's word for who a secure-aggregation epoch's members are: an explicit
    opt-out, since a server that invents the other members reads this cluster's update from its upload alone.
    Without it (the default), a cluster with no `secagg_peers` refuses every masked round and key setup."""

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
        for name, high in PLAN_LIMITS.items():
            _int_in(name, getattr(self, name), low=1, high=high)
        for name in ("planned_local_steps", "planned_batch_size"):
            if self.mode == "client" and getattr(self, name) is not None:
                raise ConfigError(f"privacy policy '{name}' is for mode 'sample' only (a 'client' policy plans one "
                                  f"release per round); drop it")
        self._check_secagg()

    def _check_secagg(self) -> None:
        if not isinstance(self.require_secure_aggregation, bool):
            raise ConfigError(f"privacy policy 'require_secure_aggregation' is {self.require_secure_aggregation!r}; "
                              "use true or false")
        if self.secagg_peers is not None and (not isinstance(self.secagg_peers, str) or not self.secagg_peers.strip()):
            raise ConfigError(f"privacy policy 'secagg_peers' is {self.secagg_peers!r}; use the path of the "
                              "federation's roster of secure-aggregation identity keys")
        if not isinstance(self.secagg_trust_server_membership, bool):
            raise ConfigError("privacy policy 'secagg_trust_server_membership' is "
                              f"{self.secagg_trust_server_membership!r}; use true or false")
        if self.secagg_trust_server_membership and self.secagg_peers is not None:
            raise ConfigError("privacy policy sets both 'secagg_peers' and 'secagg_trust_server_membership'; the "
                              "roster says who the members are, so drop secagg_trust_server_membership")
        _int_in("min_secagg_threshold", self.min_secagg_threshold, low=2, high=1_000_000)
        _int_in("min_secagg_clusters", self.min_secagg_clusters, low=2, high=1_000_000)
        if not self.require_secure_aggregation:
            for name in ("min_secagg_threshold", "min_secagg_clusters"):
                if getattr(self, name) is not None:
                    raise ConfigError(f"privacy policy sets '{name}' without 'require_secure_aggregation'; set "
                                      f"require_secure_aggregation to true, or drop {name}")
            return
        if self.secagg_trust_server_membership:
            raise ConfigError("privacy policy requires secure aggregation but takes the server's word for its "
                              "members ('secagg_trust_server_membership'), which could invent them; give "
                              "'secagg_peers' (the roster) instead")
        if self.secagg_peers is None:
            raise ConfigError("privacy policy requires secure aggregation but sets no 'secagg_peers'; give the roster "
                              "of the other clusters' identity keys (without them the server could count clusters "
                              "of its own)")
        if self.min_secagg_clusters is not None and self.min_secagg_clusters < self.secagg_threshold:
            raise ConfigError(f"privacy policy 'min_secagg_clusters' is {self.min_secagg_clusters}, below the "
                              f"threshold {self.secagg_threshold}; use at least {self.secagg_threshold}")

    @property
    def budget(self) -> float | None:
        """The lifetime ε: `max_epsilon`, else `target_epsilon`, else (DP modes) the default; None only when off."""
        if self.max_epsilon is not None:
            return self.max_epsilon
        if self.target_epsilon is not None:
            return self.target_epsilon
        return DEFAULT_MAX_EPSILON if self.mode != "off" else None

    @property
    def budget_is_default(self) -> bool:
        """The policy sets neither max_epsilon nor target_epsilon: `DEFAULT_MAX_EPSILON` is in force."""
        return self.mode != "off" and self.max_epsilon is None and self.target_epsilon is None

    @property
    def secagg_threshold(self) -> int | None:
        """The fewest clusters whose sum the server may unmask (None: secure aggregation not required)."""
        if not self.require_secure_aggregation:
            return None
        return self.min_secagg_threshold if self.min_secagg_threshold is not None else 2

    @property
    def secagg_clusters(self) -> int | None:
        """The fewest clusters masked together in a round (None: secure aggregation not required)."""
        if not self.require_secure_aggregation:
            return None
        return self.min_secagg_clusters if self.min_secagg_clusters is not None else self.secagg_threshold

    def _missing_plan(self) -> list[str]:
        names = ["planned_rounds"] + (["planned_local_steps"] if self.mode == "sample" else [])
        return [name for name in names if getattr(self, name) is None]

    def planned_releases(self, num_examples: int) -> tuple[float, int]:
        """(q, releases) of the operator's plan, over which `target_epsilon` sets the σ floor."""
        missing = self._missing_plan()
        if missing:
            raise ConfigError(f"privacy policy sets target_epsilon but not {' and '.join(missing)}: the σ floor is "
                              f"derived from the operator's plan; set {' and '.join(missing)}, or give "
                              "min_noise_multiplier instead")
        if self.mode == "client":
            return 1.0, int(self.planned_rounds)
        batch = self.planned_batch_size or math.ceil(num_examples / DP_BATCH_FRACTION)
        return sample_rate_for(num_examples, logical_batch=batch), int(self.planned_rounds * self.planned_local_steps)

    def resolved_delta(self, num_examples: int) -> float:
        """δ in force: the operator's, or the default; never as large as 1/n for per-example DP."""
        if self.delta is not None:
            return float(self.delta)
        if self.mode == "sample":
            return min(DEFAULT_DELTA, 1.0 / (10 * max(1, num_examples)))
        return DEFAULT_DELTA

    def check_for(self, num_examples: int) -> None:
        """What the trainer refuses to start with: a δ that could expose a whole record outright (δ must stay
        below 1/n, 'sample'), a target ε with no plan to spend it over, a roster of peers it cannot read."""
        if self.mode != "off" and self.target_epsilon is not None:
            self.planned_releases(num_examples)
        if self.secagg_peers is not None and not Path(self.secagg_peers).expanduser().is_file():
            raise ConfigError(f"privacy policy 'secagg_peers' is '{self.secagg_peers}', which is not a file; give the "
                              "path of the federation's roster of identity keys")
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


def policy_for_run(asked: Any, *, rounds: int, local_steps: int) -> PrivacyPolicy:
    """The policy a cluster operator who wants exactly what a run config asks would write (the launcher's).

    `asked` is a ``PrivacyConfig``: its mode, noise multiplier (as the floor) or target ε, budget, δ,
    clipping norm and accountant become the policy; with a target ε the run's `rounds`, `local_steps` and
    logical batch (``privacy.batch-size``, or the recipe's default) become the plan the floor is derived over.
    """
    if asked.mode == "off":
        return PrivacyPolicy(accountant=asked.accountant)
    plan: dict[str, Any] = {}
    if asked.target_epsilon is not None:
        plan["planned_rounds"] = rounds
        if asked.mode == "sample":
            plan.update(planned_local_steps=local_steps, planned_batch_size=asked.batch_size)
    return PrivacyPolicy(mode=asked.mode, min_noise_multiplier=asked.noise_multiplier,
                         target_epsilon=asked.target_epsilon, max_epsilon=asked.max_epsilon, delta=asked.delta,
                         max_grad_norm=asked.max_grad_norm, accountant=asked.accountant, **plan)


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
    `planned_steps` is the request's planned number of such steps (rounds × local steps), or of rounds
    in client mode, over which a request's own target ε is read; the policy's floor uses the policy's
    plan only. `derive_sigma(target_epsilon, delta, sample_rate, steps)` is the σ that spends a
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
    if floor is None and policy.target_epsilon is not None:  # from the operator's plan, never the request's
        floor = derive_sigma(policy.target_epsilon, delta, *policy.planned_releases(num_examples))
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
