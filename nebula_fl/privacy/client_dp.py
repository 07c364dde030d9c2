"""Client-level DP (DP-FedAvg, McMahan et al. 2018): clip each cluster's update, add Gaussian noise, account on the server.

One cluster's whole contribution to a round is its update Δ. Clipping Δ to L2 norm C bounds what
any one cluster can move the **sum** of updates by C; Gaussian noise of std σ·C on that sum makes
each round a Gaussian mechanism with noise multiplier σ, and sampling a fraction q of the clusters
per round amplifies it: the server accounts one Poisson-subsampled Gaussian step (σ, q) per round
with an Opacus accountant (``ServerDPAccountant``).

What the integrator must keep for this to hold:

- the sensitivity is on the *sum*: aggregate clipped updates with equal weights and divide the noisy
  sum by a fixed denominator (the expected number of sampled clusters), not by example counts;
- noise either comes from the server once (std σC on the sum) or from each of ``shares`` clusters
  (std ``noise_share_std`` = σC/√shares each, so the sum of the shares has std σC, which is what
  secure aggregation needs: the server never sees an un-noised update);
- Opacus's accountants assume Poisson sampling with rate q; a strategy sampling a fixed number of
  clusters per round is accounted as if it sampled each with q = sampled / clusters (the usual
  approximation); q = 1 (every cluster every round) needs no sampling assumption at all.
"""

from __future__ import annotations

import math
from numbers import Real
from typing import Any

import numpy as np

from nebula_fl.privacy.ledger import PrivacyLedger

Arrays = dict[str, np.ndarray]


def _check_positive(name: str, value: Any, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) \
            or value < 0 or (value == 0 and not allow_zero):
        bound = "≥ 0" if allow_zero else "> 0"
        raise ValueError(f"{name} is {value!r}; pass a finite number {bound}")
    return float(value)


def global_norm(update: Arrays) -> float:
    """The L2 norm of all tensors of ``update`` taken together (float64)."""
    total = 0.0
    for name, value in update.items():
        array = np.asarray(value)
        if not np.issubdtype(array.dtype, np.floating):
            raise ValueError(f"update tensor {name!r} has dtype {array.dtype}; client-level DP clips float tensors only")
        total += float(np.sum(np.square(array, dtype=np.float64)))
    norm = math.sqrt(total)
    if not math.isfinite(norm):
        bad = [k for k, v in update.items() if not np.all(np.isfinite(v))]
        raise ValueError(f"update has non-finite values in {', '.join(bad) or 'its tensors'}; drop it before clipping")
    return norm


def clip_update(update: Arrays, *, max_norm: float) -> tuple[Arrays, float]:
    """Scale ``update`` by min(1, C / ‖Δ‖) (one factor for all tensors); returns (clipped, norm before clipping).

    Each tensor keeps its dtype; an update already within C is returned unchanged (copies). The
    scale is nudged down if rounding to the tensors' dtype would leave the norm a hair above C.
    """
    limit = _check_positive("max_norm", max_norm)
    norm = global_norm(update)
    if norm <= limit:
        return {k: np.array(v, copy=True) for k, v in update.items()}, norm
    scale = limit / norm
    for _ in range(8):
        clipped = {k: (np.asarray(v, dtype=np.float64) * scale).astype(np.asarray(v).dtype) for k, v in update.items()}
        if global_norm(clipped) <= limit:
            break
        scale *= 1.0 - 1e-6
    return clipped, norm


def noise_share_std(*, noise_multiplier: float, max_norm: float, shares: int) -> float:
    """The std each of ``shares`` clusters adds so that the sum of their noise has std σ·C: σC / √shares."""
    sigma = _check_positive("noise_multiplier", noise_multiplier, allow_zero=True)
    limit = _check_positive("max_norm", max_norm)
    if isinstance(shares, bool) or not isinstance(shares, int | np.integer) or shares < 1:
        raise ValueError(f"shares is {shares!r}; pass the number of clusters adding noise (an integer ≥ 1)")
    return sigma * limit / math.sqrt(int(shares))


def add_gaussian(update: Arrays, *, std: float, rng: np.random.Generator) -> Arrays:
    """``update`` + N(0, std²) per coordinate, drawn from ``rng`` in key order; float64 inside, float32 out."""
    scale = _check_positive("std", std, allow_zero=True)
    if not isinstance(rng, np.random.Generator):
        raise ValueError(f"rng is a {type(rng).__name__}; pass a numpy.random.Generator (np.random.default_rng(seed))")
    out: Arrays = {}
    for name, value in update.items():
        array = np.asarray(value, dtype=np.float64)
        out[name] = (array + rng.normal(0.0, scale, size=array.shape)).astype(np.float32)
    return out


class ServerDPAccountant(PrivacyLedger):
    """The server's ledger for client-level DP: one subsampled Gaussian step (σ, q = sampled / clusters) per round.

    It is a ``PrivacyLedger`` whose steps are rounds: ``epsilon``, ``epsilon_after``, ``describe``,
    ``state_dict``/``load_state_dict`` are the same (``epsilon_after(steps=k)`` = after k more rounds).
    """

    def record_round(self, *, noise_multiplier: float, sample_rate: float) -> None:
        self.record(noise_multiplier=noise_multiplier, sample_rate=sample_rate, steps=1)

    @property
    def rounds(self) -> int:
        return self.steps_total

    def metrics_entry(self, **_: Any) -> dict[str, Any]:  # type: ignore[override]
        """The round line's top-level ``privacy`` object, as the privacy report reads it."""
        last = self.history[-1] if self.history else (None, None, 0)
        return {"mode": "client", "epsilon": self.epsilon(), "delta": self.delta, "noise_multiplier": last[0],
                "sample_rate": last[1], "rounds": self.rounds, "accountant": self.accountant}

    def __repr__(self) -> str:
        return f"ServerDPAccountant(accountant={self.accountant!r}, delta={self.delta:g}, rounds={self.rounds})"
