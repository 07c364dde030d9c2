"""What a cluster may reveal about another, so that the server never gets both halves of one secret.

For a cluster i, a share holder j can reveal three things: a share of i's self-mask seed of round r
(i uploaded in r), the round-r key of its pairwise mask with i (i dropped out of r before uploading),
or a share of i's mask private key (i dropped and j, who could have revealed that pair key, is gone
too). The server must never learn, for a round in which i uploaded, both i's self mask and i's
pairwise masks, so a holder refuses:
- a self-mask share of i for round r after revealing its round-r pair key with i, and the reverse;
- a key share of i after revealing any self-mask share of i under that key (rounds are unmasked with
  the key for the whole epoch, so the key would unmask them all), and the reverse;
- a key share of i unless the server said, in this epoch's unmasking of round r, that i dropped.
The threshold is more than half of the holders, so no two disjoint groups can rebuild both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RevealLog:
    """One holder's reveals within one key epoch."""

    self_shares: dict[int, set[str]] = field(default_factory=dict)  # round -> clusters (self-mask shares)
    pair_keys: dict[int, set[str]] = field(default_factory=dict)  # round -> clusters (pair keys with them)
    key_shares: set[str] = field(default_factory=set)  # clusters whose key shares were revealed
    dropped: dict[int, set[str]] = field(default_factory=dict)  # round -> clusters the server said dropped

    def any_self_share(self, cid: str) -> bool:
        return any(cid in s for s in self.self_shares.values())

    def state_dict(self) -> dict[str, Any]:
        return {"self_shares": {str(r): sorted(s) for r, s in self.self_shares.items()},
                "pair_keys": {str(r): sorted(s) for r, s in self.pair_keys.items()},
                "key_shares": sorted(self.key_shares),
                "dropped": {str(r): sorted(s) for r, s in self.dropped.items()}}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> RevealLog:
        return cls(self_shares={int(r): set(s) for r, s in state.get("self_shares", {}).items()},
                   pair_keys={int(r): set(s) for r, s in state.get("pair_keys", {}).items()},
                   key_shares=set(state.get("key_shares", [])),
                   dropped={int(r): set(s) for r, s in state.get("dropped", {}).items()})


def refuse_unmask(log: RevealLog, *, server_round: int, survivors: set[str], dropped: set[str]) -> str | None:
    """Why this holder refuses to unmask round `server_round` as asked, or None."""
    both = survivors & dropped
    if both:
        return f"the server lists cluster(s) {sorted(both)} as both survived and dropped in round {server_round}"
    keyed = survivors & log.key_shares
    if keyed:
        return f"the key of cluster(s) {sorted(keyed)} was revealed in this epoch; their self masks stay hidden"
    flipped = (survivors & log.pair_keys.get(server_round, set())) | (dropped & log.self_shares.get(server_round, set()))
    if flipped:
        return f"cluster(s) {sorted(flipped)} were already unmasked the other way in round {server_round}"
    said = log.dropped.get(server_round)
    if said is not None and said != dropped:
        return f"round {server_round} was unmasked already with other dropouts ({sorted(said)})"
    return None


def refuse_recover(log: RevealLog, *, server_round: int, clusters: set[str]) -> str | None:
    """Why this holder refuses key shares of `clusters` for round `server_round`, or None."""
    not_dropped = clusters - log.dropped.get(server_round, set())
    if not_dropped:
        return f"cluster(s) {sorted(not_dropped)} did not drop out of round {server_round}"
    shown = {c for c in clusters if log.any_self_share(c)}
    if shown:
        return (f"a self-mask share of cluster(s) {sorted(shown)} was revealed under this key; "
                "their key share would unmask those rounds")
    return None
