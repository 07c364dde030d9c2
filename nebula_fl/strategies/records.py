"""What a strategy decided in a round, as the strategy says it: per cluster and for the round.

A plain mean needs no explanation, a robust aggregator does: which clusters it kept, which it dropped, the
scores it ranked them by. ``AdapterStrategy.record`` / ``record_round`` put those values here; the round's
line in metrics.jsonl carries them (``clusters.<id>.strategy`` and ``strategy``), and TensorBoard draws the
numbers. Values are checked as they are recorded, so a plug-in's mistake is a one-line error naming it at the
line that made it, not a corrupt metrics file later. The reserved key ``kept`` (a bool) says whether the
cluster's update entered the aggregate: it is what ``clusters_aggregated`` counts.
"""

from __future__ import annotations

import math
import re
from typing import Any

KEY = re.compile(r"[a-z][a-z0-9_]{0,39}")
MAX_TEXT = 80  # characters of a recorded string: a label, not a report
KEPT = "kept"

Value = bool | int | float | str


class StrategyRecords:
    """One round's records of one strategy; ``clear`` starts the next round's."""

    def __init__(self, *, strategy: str) -> None:
        self.strategy = strategy
        self.clusters: dict[str, dict[str, Value]] = {}
        self.round: dict[str, Value] = {}

    def clear(self) -> None:
        self.clusters = {}
        self.round = {}

    def add_cluster(self, cluster: str, values: dict[str, Any]) -> None:
        entry = self.clusters.setdefault(cluster, {})
        for key, value in values.items():
            entry[key] = self._checked(key, value, where=f"for cluster {cluster}")

    def add_round(self, values: dict[str, Any]) -> None:
        for key, value in values.items():
            if key == KEPT:
                raise ValueError(f"strategy '{self.strategy}' recorded '{KEPT}' for the round; '{KEPT}' belongs to "
                                 "one cluster: record(index, kept=...)")
            self.round[key] = self._checked(key, value, where="for the round")

    def dropped(self) -> int:
        """How many clusters the strategy said it left out of the aggregate (``kept=False``)."""
        return sum(1 for values in self.clusters.values() if values.get(KEPT) is False)

    def notes(self) -> dict[str, dict[str, Any]]:
        """Per-cluster records as round notes: cluster id -> {"strategy": {...}}."""
        return {cid: {"strategy": dict(values)} for cid, values in self.clusters.items() if values}

    def summary(self) -> dict[str, Any]:
        """Round-level records as the round line's ``strategy`` object; nothing when none were recorded."""
        return {"strategy": dict(self.round)} if self.round else {}

    def _checked(self, key: Any, value: Any, *, where: str) -> Value:
        said = f"strategy '{self.strategy}' recorded {key!r}={value!r} {where}"
        if not isinstance(key, str) or not KEY.fullmatch(key):
            raise ValueError(f"{said}: a key is lower_snake_case, at most 40 characters; rename it")
        if key == KEPT and not isinstance(value, bool):
            raise ValueError(f"{said}: '{KEPT}' is True or False (whether the update entered the aggregate)")
        if isinstance(value, bool):
            return value
        if isinstance(value, int | float) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ValueError(f"{said}: record finite numbers only")
            return int(value) if isinstance(value, int) else float(value)
        if hasattr(value, "item") and getattr(value, "shape", None) == ():  # a numpy scalar
            return self._checked(key, value.item(), where=where)
        if isinstance(value, str):
            if len(value) > MAX_TEXT or "\n" in value:
                raise ValueError(f"{said}: a recorded string is one line of at most {MAX_TEXT} characters")
            return value
        raise ValueError(f"{said}: record a number, a bool or a short string")
