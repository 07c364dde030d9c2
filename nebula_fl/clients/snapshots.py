"""A cluster's training snapshots: every rank's inner state after each round it trained, per federation.

A snapshot holds what training needs to continue exactly (AdamW moments, batch stream, RNG, the view
of the global adapter, the uplink codec's error-feedback residual), never the privacy ledger, which
is append-only and lives on its own (``privacy/cluster_ledger.py``): restoring a snapshot can rewind
training, never the privacy spent. Files are written whole (temp file + rename), read without pickle.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

KEEP = 3


class SnapshotStore:
    def __init__(self, folder: str | Path, *, keep: int = KEEP) -> None:
        self.folder = Path(folder)
        self.keep = keep

    def rounds(self) -> list[int]:
        if not self.folder.is_dir():
            return []
        found = (re.fullmatch(r"round-(\d+)\.pt", p.name) for p in self.folder.glob("round-*.pt"))
        return sorted(int(m.group(1)) for m in found if m)

    def _path(self, server_round: int) -> Path:
        return self.folder / f"round-{server_round:05d}.pt"

    def save(self, server_round: int, *, world: int, ranks: list[Any]) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        target = self._path(server_round)
        tmp = target.with_suffix(".tmp")
        torch.save({"world": world, "ranks": ranks}, tmp)
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, target)
        for old in self.rounds()[: -self.keep]:
            self._path(old).unlink(missing_ok=True)

    def newest_before(self, server_round: int) -> int | None:
        earlier = [r for r in self.rounds() if r < server_round]
        return earlier[-1] if earlier else None

    def load(self, server_round: int) -> dict[str, Any]:
        # onto the CPU first: a snapshot written on a GPU restores on a machine without one (or with another
        # numbering); the optimizer moves its state to its parameters' device as it loads it
        return torch.load(self._path(server_round), weights_only=True, map_location="cpu")
