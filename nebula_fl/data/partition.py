"""Split example indices across clusters: IID, or label-skewed with a Dirichlet prior.

Pure functions of (labels, number of clusters, seed), so every cluster computes its own shard from
the same inputs and gets the same answer without talking to anyone.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def parse_partition(spec: str) -> tuple[str, float | None]:
    """Parse 'iid' or 'dirichlet:ALPHA' into (kind, alpha)."""
    if spec == "iid":
        return "iid", None
    kind, _, arg = spec.partition(":")
    if kind == "dirichlet":
        try:
            alpha = float(arg)
        except ValueError:
            raise ValueError(f"is '{spec}': 'dirichlet:ALPHA' needs a number, e.g. dirichlet:0.5") from None
        if not alpha > 0:
            raise ValueError(f"is '{spec}': the Dirichlet alpha must be > 0")
        return "dirichlet", alpha
    raise ValueError(f"is '{spec}': use 'iid' or 'dirichlet:ALPHA' (e.g. dirichlet:0.5)")


def iid_partition(num_examples: int, num_parts: int, *, seed: int) -> list[np.ndarray]:
    """Shuffle and deal the indices into `num_parts` shards whose sizes differ by at most one."""
    _check_parts(num_parts)
    order = np.random.default_rng(seed).permutation(num_examples)
    return [np.sort(p) for p in np.array_split(order, num_parts)]


def dirichlet_partition(
    labels: Sequence[int] | np.ndarray, num_parts: int, *, alpha: float, seed: int
) -> list[np.ndarray]:
    """Label skew: each class is divided across shards in proportions drawn from Dir(alpha).

    Small alpha gives each shard few classes; large alpha approaches an IID split.
    """
    _check_parts(num_parts)
    labels = np.asarray(labels)
    rng = np.random.default_rng(seed)
    shards: list[list[np.ndarray]] = [[] for _ in range(num_parts)]
    for cls in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == cls))
        proportions = rng.dirichlet(np.full(num_parts, alpha))
        cuts = (np.cumsum(proportions)[:-1] * len(members)).round().astype(int)
        for shard, piece in zip(shards, np.split(members, cuts), strict=True):
            shard.append(piece)
    return [np.sort(np.concatenate(s)) if s else np.empty(0, dtype=int) for s in shards]


def partition(labels: Sequence[int] | np.ndarray, num_parts: int, *, spec: str, seed: int) -> list[np.ndarray]:
    """Dispatch on a partition spec ('iid' or 'dirichlet:ALPHA')."""
    kind, alpha = parse_partition(spec)
    if kind == "iid":
        return iid_partition(len(labels), num_parts, seed=seed)
    assert alpha is not None
    return dirichlet_partition(labels, num_parts, alpha=alpha, seed=seed)


def label_skew(labels: Sequence[int] | np.ndarray, parts: Sequence[np.ndarray]) -> float:
    """Mean total-variation distance between each shard's label distribution and the global one.

    0 for a perfectly stratified split; approaches 1 when each shard holds a class nobody else has.
    """
    labels = np.asarray(labels)
    classes = np.unique(labels)
    overall = np.array([(labels == c).mean() for c in classes])
    distances = []
    for part in parts:
        if len(part) == 0:
            continue
        local = np.array([(labels[part] == c).mean() for c in classes])
        distances.append(0.5 * np.abs(local - overall).sum())
    return float(np.mean(distances))


def _check_parts(num_parts: int) -> None:
    if num_parts < 1:
        raise ValueError(f"cannot partition into {num_parts} clusters; use 1 or more")
