"""What a cluster reveals, and why a lying server learns no sum of fewer than `threshold` clusters.

THREAT MODEL. The server and the network may be malicious: they may show each cluster a different
survivor/dropout set, claim dropouts that did not happen, replay, reorder, drop or invent any message.
They cannot forge a cluster's signature (identity.py), and every member of a key epoch is on each honest
cluster's roster, so the server cannot add members of its own. A cluster that colludes with the server
counts against the bound below; a cluster can always corrupt its own input (nothing here stops that).

THE BOUND. Each cluster's secrets are Shamir-shared among its *holders* (itself and its neighbours in
the epoch's graph, graph.py) with threshold t > holders / 2 (checked when the shares are made). With c
colluding clusters among one cluster's holders the guarantee needs t > (holders + c) / 2.

THE RULES (each holder h; every round r of an epoch):
0. One mask key, one round. Every cluster has one mask key (an EC key pair) per round r, made once and
   bound to r by its owner's signature of (epoch, setup, owner, r, public half); its private half is
   Shamir-shared among the owner's holders, each share sealed to its holder and labelled with r. The key
   of r rides on the owner's upload of r − 1 (or, when the server lacks it, a next-key reply; the epoch's
   setup key is bound to the epoch's first round) and reaches the holders on r's train messages: no extra
   trip. A cluster masks r only with keys bound to r — its own and each neighbour's, checked — so the pair
   mask of i and j in r, keyed by HKDF(ECDH(i's key of r, j's key of r), epoch, r), and the self mask (a
   fresh seed) mask r alone. The rules below are per round, and rounds compose.
1. One round set. h masks r once, under the round set R its train message names, which must hold h and
   at least t of h's holders. h reveals only for rounds it uploaded, only about clusters in R.
2. One view. A view is (survivors S, dropped D) with S ∪ D = R, S ∩ D = ∅, h ∈ S. The first view h
   accepts for r, by signing it or by revealing under it, is the only one it ever acts on: any other
   view of r is refused; the same request again gets the same answer.
3. Evidence. The *full view* (D = ∅) needs an upload receipt of every member of R for this R: nobody
   dropped. A *dropout view* needs valid signatures of exactly (R, S) from at least t of h's holders
   and from at least t of the holders of each neighbour of h in D (evidence.py), and the receipt of every
   neighbour of h in S. Every receipt names the keys its signer masked r with (its own and its
   neighbours', by the round they are bound to): h acts only if each surviving neighbour's receipt names
   the keys h used for their pair (rule 0 already makes them r's; this check is cheap and would catch a
   key of another round however it got there). Every receipt and signature binds the epoch's setup as its signer saw it
   (members, keys, threshold): a server that shows clusters different setups splits them into camps whose
   signatures never count for each other, and the argument below holds inside each camp.
4. Reveals. Under its view h reveals the self-mask shares of its holders in S and its pair keys with its
   neighbours in D, nothing else. h never reveals both j's self-mask share of r and its share of j's mask
   key of r; a share of j's key of r only after h unmasked r under a view with j in D (its evidence
   checked: a signature alone proves nothing).

WHY IT HOLDS. Take a cluster j and a round r. To isolate j's upload of r the server needs (a) j's self
mask of r: t of j's holders revealing their share under views of r in which j survived; and (b) j's
mask with some neighbour from a view of r in which j dropped: t of j's holders signing that view (rule 3;
each acts on one view of r, rule 2), or t revealing their share of j's key of r (rule 4). Each holder
gives (a) or (b), never both, so both need 2t > holders distinct holders of j: impossible. A sum over a set C of clusters is unmasked only if every member's self mask is rebuilt
(so no member had (b)) and every mask between C and the rest is revealed. A member c's mask with a
neighbour outside C was then revealed by c itself (under a view certified by t of c's holders, all
survivors of it: their masks with c stay hidden, so they are in C) or, when c revealed none, c's holders
in R keep theirs hidden and are in C; either way |C| >= t. Across rounds: everything revealed for r —
self shares, pair keys, shares of keys of r — is a function of secrets that mask r alone (rule 0), and
every rule above is about r alone, so what the server gathers over any number of rounds, epochs (fresh
keys, other ids) and federations (other state, other ids) is, round by round, what one round's argument
allows. (Binding keys to rounds is what makes this so. With one key an epoch, a key rebuilt for the round
its owner dropped out of also opens its pair masks of every other round of the epoch, with a cluster whose
self mask of such a round was revealed: that cluster's update. With a key numbered per use whose round the
server names, t holders told in round r' that a neighbour a of j dropped, a's key being the one a masked an
earlier round with, give that key, which opens a's pair mask with j of that earlier round.
tests/secagg_campaign.py searches schedules of both kinds: the first layout leaks, this one does not.) So
the server learns no single update and no sum of fewer than t clusters of one round, whatever it says to
whom and whenever it asks. Colluding clusters: their shares count for the server; with c of them among a
cluster's holders the argument needs t > (holders + c) / 2, and a sum over C reveals Σ over C's honest
members, |C| - c of them. A round without dropouts reveals only self shares, on the receipts it already
carries: no extra trip; a round with dropouts costs one (the survivors sign their view).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def key_id(cluster: str, seq: int) -> str:
    """A mask key's name in a holder's log: its owner and its number."""
    return f"{cluster}/{int(seq)}"


@dataclass
class RevealLog:
    """One holder's commitments and reveals within one key epoch."""

    self_shares: dict[int, set[str]] = field(default_factory=dict)  # round -> clusters (self-mask shares)
    self_keys: set[str] = field(default_factory=set)  # key ids (owner/number) whose owner's self share was revealed
    pair_keys: dict[int, set[str]] = field(default_factory=dict)  # round -> clusters (pair keys with them)
    key_shares: set[str] = field(default_factory=set)  # key ids whose share was revealed
    views: dict[int, list[list[str]]] = field(default_factory=dict)  # round -> [survivors, dropped] acted on
    certified: set[int] = field(default_factory=set)  # rounds whose view this holder saw the evidence of (rule 3)

    def dropped(self, server_round: int) -> set[str]:
        """Who dropped out of `server_round` in the view this holder unmasked it under (signing alone is no proof)."""
        view = self.views.get(server_round)
        return set(view[1]) if view and server_round in self.certified else set()

    def state_dict(self) -> dict[str, Any]:
        return {"self_shares": {str(r): sorted(s) for r, s in self.self_shares.items()},
                "self_keys": sorted(self.self_keys),
                "pair_keys": {str(r): sorted(s) for r, s in self.pair_keys.items()},
                "key_shares": sorted(self.key_shares),
                "views": {str(r): [sorted(v[0]), sorted(v[1])] for r, v in self.views.items()},
                "certified": sorted(self.certified)}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> RevealLog:
        return cls(self_shares={int(r): set(s) for r, s in state.get("self_shares", {}).items()},
                   self_keys=set(state.get("self_keys", [])),
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


def refuse_keys(mine: dict[str, int], *, me: str, receipts: dict[str, dict[str, int]], survivors: set[str]) -> str | None:
    """Rule 3's key check: every surviving neighbour's receipt names the keys this holder used for their pair
    (`mine`: cluster -> key number, itself and its neighbours in the round, as it masked)."""
    for other in sorted(survivors & set(mine) - {me}):
        theirs = receipts.get(other)
        if theirs is None:
            return f"no valid upload receipt of surviving neighbour {other}"
        if theirs.get(other) != mine[other] or theirs.get(me) != mine[me]:
            return (f"cluster {other} masked with keys {other}/{theirs.get(other)} and {me}/{theirs.get(me)}, this "
                    f"cluster with {other}/{mine[other]} and {me}/{mine[me]}: the server showed one of them another key")
    return None


def refuse_unmask(log: RevealLog, *, server_round: int, survivor_keys: dict[str, str]) -> str | None:
    """Rule 4 for the self-mask shares asked (`survivor_keys`: survivor -> the id of the key it masked with)."""
    keyed = sorted(c for c, k in survivor_keys.items() if k in log.key_shares)
    if keyed:
        return f"a share of the mask key of cluster(s) {keyed} for this round was revealed; their self masks stay hidden"
    return None


def refuse_recover(log: RevealLog, *, server_round: int, wanted: dict[str, str]) -> str | None:
    """Rule 4: why this holder refuses the shares of `wanted` (cluster -> id of the key it masked
    `server_round` with, as this holder masked it), or None."""
    not_dropped = set(wanted) - log.dropped(server_round)
    if not_dropped:
        return f"cluster(s) {sorted(not_dropped)} did not drop out of round {server_round} in the view this cluster agreed"
    shown = sorted(c for c, k in wanted.items() if k in log.self_keys)
    if shown:
        return (f"a self-mask share of cluster(s) {shown} under the same mask key was revealed; "
                "that key's share would unmask it")
    return None
