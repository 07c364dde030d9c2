"""What a cluster reveals, and why a lying server learns no sum of fewer than `threshold` clusters.

THREAT MODEL. The server and the network may be malicious: they may show each cluster a different
survivor/dropout set, claim dropouts that did not happen, replay, reorder, drop or invent any message.
They cannot forge a cluster's signature (identity.py), and every member of a key epoch is on each honest
cluster's roster, so the server cannot add members of its own. A cluster that colludes with the server
counts against the bound below; a cluster can always corrupt its own input (nothing here stops that).

THE BOUND. Each cluster's secrets are Shamir-shared among its *holders* (itself and its neighbours in
the epoch's graph, graph.py) with threshold t > holders / 2 (checked when the shares are made). With c
colluding clusters among one cluster's holders the guarantee needs t > (holders + c) / 2.

THE RULES (each holder h, each round r of an epoch):
1. One round set. h masks r once, under the round set R its train message names, which must hold h and
   at least t of h's holders. h reveals only for rounds it uploaded, only about clusters in R.
2. One view. A view is (survivors S, dropped D) with S ∪ D = R, S ∩ D = ∅, h ∈ S. The first view h
   accepts for r, by signing it or by revealing under it, is the only one it ever acts on: any other
   view of r is refused; the same request again gets the same answer.
3. Evidence. The *full view* (D = ∅) needs an upload receipt of every member of R for this R: nobody
   dropped. A *dropout view* needs valid signatures of exactly (R, S) from at least t of h's holders
   and from at least t of the holders of each neighbour of h in D (evidence.py). Every receipt and
   signature binds the epoch's setup as its signer saw it (members, keys, threshold): a server that shows
   clusters different setups splits them into camps whose signatures never count for each other, and
   the argument below holds inside each camp.
4. Reveals. Under its view h reveals the self-mask shares of its holders in S and its pair keys with its
   neighbours in D, nothing else. Never a self-mask share of a cluster whose key share h revealed in this
   epoch; a key share of a cluster j only after h unmasked r under a view with j in D (its evidence
   checked: a signature alone proves nothing) and only if h revealed no self-mask share of j in this
   epoch (the key unmasks every round of the epoch).

WHY IT HOLDS. For any cluster j and round r, the server would need (a) j's self mask: t of j's holders
revealing its share under views in which j survived, and (b) some mask of j from a view in which j
dropped: t of j's holders signing that view (rule 3), or t revealing j's key share (rule 4). Each holder
acts on one view per round (rule 2) and never gives both a self share and the key share of j in one epoch
(rule 4), so (a) and (b) need 2t > holders distinct holders of j: impossible. A sum over a set C of
clusters is unmasked only if every member's self mask is rebuilt (so no member had (b)) and every mask
between C and the rest is revealed. A member c's mask with a neighbour outside C was then revealed by c
itself (under a view certified by t of c's holders, all survivors of it: their masks with c stay hidden,
so they are in C) or, when c revealed none, c's holders in R keep theirs hidden and are in C; either way
|C| >= t. So the server learns no single update and no sum of fewer than t clusters, whatever it says
to whom. A round without dropouts reveals only self shares, on the receipts it already carries: no
extra trip; a round with dropouts costs one (the survivors sign their view).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RevealLog:
    """One holder's commitments and reveals within one key epoch."""

    self_shares: dict[int, set[str]] = field(default_factory=dict)  # round -> clusters (self-mask shares)
    pair_keys: dict[int, set[str]] = field(default_factory=dict)  # round -> clusters (pair keys with them)
    key_shares: set[str] = field(default_factory=set)  # clusters whose key shares were revealed
    views: dict[int, list[list[str]]] = field(default_factory=dict)  # round -> [survivors, dropped] acted on
    certified: set[int] = field(default_factory=set)  # rounds whose view this holder saw the evidence of (rule 3)

    def any_self_share(self, cid: str) -> bool:
        return any(cid in s for s in self.self_shares.values())

    def dropped(self, server_round: int) -> set[str]:
        """Who dropped out of `server_round` in the view this holder unmasked it under (signing alone is no proof)."""
        view = self.views.get(server_round)
        return set(view[1]) if view and server_round in self.certified else set()

    def state_dict(self) -> dict[str, Any]:
        return {"self_shares": {str(r): sorted(s) for r, s in self.self_shares.items()},
                "pair_keys": {str(r): sorted(s) for r, s in self.pair_keys.items()},
                "key_shares": sorted(self.key_shares),
                "views": {str(r): [sorted(v[0]), sorted(v[1])] for r, v in self.views.items()},
                "certified": sorted(self.certified)}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> RevealLog:
        return cls(self_shares={int(r): set(s) for r, s in state.get("self_shares", {}).items()},
                   pair_keys={int(r): set(s) for r, s in state.get("pair_keys", {}).items()},
                   key_shares=set(state.get("key_shares", [])),
                   views={int(r): [sorted(v[0]), sorted(v[1])] for r, v in state.get("views", {}).items()},
                   certified={int(r) for r in state.get("certified", [])})


def refuse_view(log: RevealLog, *, me: str, server_round: int, round_set: set[str], survivors: set[str],
                dropped: set[str], threshold: int) -> str | None:
    """Rules 1 and 2: why holder `me` may not act on this view of `server_round`, or None."""
    if survivors & dropped:
        return f"the server lists cluster(s) {sorted(survivors & dropped)} as both survived and dropped"
    if survivors | dropped != round_set:
        return f"the survivors and dropouts {sorted(survivors | dropped)} are not round {server_round}'s clusters"
    if me not in survivors:
        return f"this cluster is not among the survivors of round {server_round}"
    if len(survivors) < threshold:
        return f"{len(survivors)} survivor(s) in round {server_round}, fewer than the threshold {threshold}"
    acted = log.views.get(server_round)
    if acted is not None and (set(acted[0]), set(acted[1])) != (survivors, dropped):
        return (f"round {server_round} was already agreed as survivors {acted[0]}, dropped {acted[1]}; "
                "a cluster acts on one view of a round")
    return None


def refuse_unmask(log: RevealLog, *, server_round: int, survivors: set[str]) -> str | None:
    """Rule 4 for the self-mask shares asked (the view itself passed refuse_view and its evidence)."""
    keyed = survivors & log.key_shares
    if keyed:
        return f"the key of cluster(s) {sorted(keyed)} was revealed in this epoch; their self masks stay hidden"
    return None


def refuse_recover(log: RevealLog, *, server_round: int, clusters: set[str]) -> str | None:
    """Rule 4: why this holder refuses key shares of `clusters` for `server_round`, or None."""
    not_dropped = clusters - log.dropped(server_round)
    if not_dropped:
        return f"cluster(s) {sorted(not_dropped)} did not drop out of round {server_round} in the view this cluster agreed"
    shown = {c for c in clusters if log.any_self_share(c)}
    if shown:
        return (f"a self-mask share of cluster(s) {sorted(shown)} was revealed under this key; "
                "their key share would unmask those rounds")
    return None
