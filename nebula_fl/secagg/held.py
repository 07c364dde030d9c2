"""A securely aggregated round whose masked uploads wait to be unmasked: everything its unmasking needs.

Without `round-overlap` a round is unmasked in its own aggregation and nothing outlives it. With it, the
unmask request of round r rides on round r+1's train message, so round r's uploads, the key epoch they were
masked under and the round's encoding wait one round on the server, are checkpointed with it (the clusters
keep their side for KEPT_ROUNDS rounds, so a resumed server can still ask) and may outlive their epoch (a
new epoch set up in round r+1 does not change what round r's holders must be asked). Everything is keyed by
cluster id: node ids change when a SuperNode restarts, clusters do not.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from nebula_fl.secagg.field import FieldCode

EPOCH_KEYS = ("id", "members", "s_pks", "ids", "setup", "threshold", "neighbours")  # what unmasking reads


@dataclass(frozen=True)
class Upload:
    """One cluster's usable upload of the round."""

    vector: np.ndarray  # the masked field vector
    tokens: dict[str, str]  # holder -> its sealed share of this cluster's self-mask seed
    commits: dict[str, Any]  # SHA-256 of the self-mask seed ("self") and of each pair key ("pairs")
    receipt: list[Any]  # [digest, signature, keys used]: the proof, forwarded to every holder, that this cluster
    # uploaded, and with which mask keys


@dataclass(frozen=True, kw_only=True)
class HeldRound:
    """One round's uploads with the epoch and encoding they were masked under."""

    server_round: int
    epoch: dict[str, Any]  # the EPOCH_KEYS of the epoch the round was masked in
    round_set: list[str]
    code: FieldCode
    federation: str
    positions: np.ndarray | None  # random-k's coordinates, or None (all)
    uploads: dict[str, Upload]
    keys: dict[str, list[Any]]  # member -> [number, public key] of the mask key it was to mask the round with

    @property
    def survivors(self) -> list[str]:
        return [c for c in self.round_set if c in self.uploads]

    @property
    def dropped(self) -> list[str]:
        return [c for c in self.round_set if c not in self.uploads]

    def state_dict(self) -> dict[str, Any]:
        """Arrays stay arrays (the checkpoint stores them apart); the rest is JSON."""
        return {"server_round": self.server_round, "epoch": {k: self.epoch[k] for k in EPOCH_KEYS},
                "round_set": list(self.round_set), "code": asdict(self.code), "federation": self.federation,
                "positions": self.positions, "keys": {c: list(k) for c, k in self.keys.items()},
                "uploads": {c: {"vector": u.vector, "tokens": dict(u.tokens), "commits": u.commits,
                                "receipt": list(u.receipt)} for c, u in self.uploads.items()}}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> HeldRound:
        positions = state.get("positions")
        return cls(server_round=int(state["server_round"]), epoch=dict(state["epoch"]),
                   round_set=list(state["round_set"]), code=FieldCode(**state["code"]),
                   federation=str(state["federation"]),
                   positions=None if positions is None else np.asarray(positions),
                   keys={c: list(k) for c, k in state.get("keys", {}).items()},
                   uploads={c: Upload(vector=np.asarray(u["vector"], dtype=np.uint64), tokens=dict(u["tokens"]),
                                      commits=dict(u["commits"]), receipt=list(u["receipt"]))
                            for c, u in state["uploads"].items()})
