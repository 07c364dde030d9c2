"""A lying server played against real cluster stages (SecAggStage), and an oracle of what it then knows.

`Epoch` sets up one key epoch over n real stages (their own identity keys and the roster of all of them),
and has every cluster (but the `absent`, who really drop out) mask one round's update with its mask key of
that round (the setup's `s` key in the epoch's first round, then the one its upload of the round before
published, or a next-key reply: reveal.py, rule 0): the server now holds every upload, every sealed share,
every receipt and every published key. A *schedule* is what the server then tells each cluster: the full
view (nobody dropped), or a survivor set S that contains it (everyone else "dropped"). Every cluster told S
is asked to sign S; every cluster is then asked to unmask under its view, with every receipt and all the
signatures the server collected for it, and to give its shares of the mask key each cluster its view says
dropped was to mask the round with. Each answer comes from the real stage restored to its state just
after the upload, so each cluster acts as if this were the only schedule ever played.

The oracle rebuilds whatever the revealed shares allow (Flower's Shamir reconstruction, checked against
the uploads' commitments and the mask keys' public halves), and, for every set T of clusters, decides
whether the server can compute the sum of T's updates: every self mask in T rebuilt, every pair mask
between T and the rest known (revealed, or derived from a rebuilt mask key and the other side's public
key of that round, with both key numbers). If it can, it does, and the result is compared with the true
weighted sum (within one quantisation step per cluster): an exposure is a real recovery, not a model of
one. Earlier rounds of the epoch (settled honestly: every self mask of them rebuilt) are checked too, with
every mask key the server ever rebuilt, since a key rebuilt now would unmask any round it masked; with
one key per round (rule 0) none did.

    .venv/bin/python -m tests.secagg_adversary    # every campaign: schedules tried, updates recovered
"""

from __future__ import annotations

import base64
import itertools
import json
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from nebula_fl.clients.secagg_stage import SecAggRefusal, SecAggStage
from nebula_fl.secagg import field as ff
from nebula_fl.secagg import graph, shares
from nebula_fl.secagg.field import FieldCode
from nebula_fl.secagg.masking import remove_masks
from nebula_fl.secagg.masks import pair_order, pair_sign, round_key
from nebula_fl.secagg.rebuild import rebuild
from nebula_fl.secagg.shares import ShareError
from nebula_fl.secagg.wire import commitment, digest, unpack_upload

FED, EPOCH = "fed1", "epoch-1"
FIRST = 1  # the epoch's first round: its mask keys are the setup's `s` keys
FAST = "full view"
COORDS = 16
BITS = 32


@dataclass
class Reveal:
    self_shares: dict[str, bytes] = field(default_factory=dict)
    pair_keys: dict[str, bytes] = field(default_factory=dict)  # neighbour -> this holder's round key with it
    key_shares: dict[str, bytes] = field(default_factory=dict)  # mask key id ("owner/number") -> this holder's share
    refusals: list[str] = field(default_factory=list)


@dataclass
class Settled:
    """An earlier round of the epoch, unmasked honestly: what the server holds of it."""

    number: int
    uploads: dict[str, np.ndarray]
    seeds: dict[str, bytes]
    pairs: dict[frozenset[str], bytes]
    updates: dict[str, np.ndarray]
    weights: dict[str, int]
    keys: dict[str, tuple[int, str]]  # member -> (number, public key) of the mask key it was to mask the round with


def _b64(text: str) -> bytes:
    return base64.b64decode(text)


class Epoch:
    def __init__(self, tmp: Path, *, n: int, threshold: int, num_shares: int = 0, seed: int = 0,
                 absent: Iterable[str] = (), rotate_keys: bool = True) -> None:
        self.n, self.t = n, threshold
        self.ids = [str(i) for i in range(n)]
        self.rng = np.random.default_rng(seed)
        self.stages = {c: SecAggStage(state_dir=tmp / f"c{c}", cluster_id=int(c), rotate_keys=rotate_keys)
                       for c in self.ids}
        roster = {c: s.identity.public for c, s in self.stages.items()}
        for s in self.stages.values():
            s.roster = roster
        self.rotate = rotate_keys  # False: the control's stage, one key (the setup's) for every round
        self.keys = {c: s.handle({"stage": "keys", "federation-id": FED, "epoch": EPOCH, "round": FIRST})
                     for c, s in self.stages.items()}
        self.share_request = {
            "stage": "share", "federation-id": FED, "epoch": EPOCH, "members": self.ids,
            "c-pks": [self.keys[c]["c-pk"] for c in self.ids], "s-pks": [self.keys[c]["s-pk"] for c in self.ids],
            "id-pks": [self.keys[c]["id-pk"] for c in self.ids],
            "key-sigs": [self.keys[c]["key-sig"] for c in self.ids], "num-shares": num_shares, "threshold": threshold,
            "round": FIRST}
        self.held: dict[str, dict[str, str]] = {c: {} for c in self.ids}  # holder -> "owner/number" -> sealed share
        for c, s in self.stages.items():
            reply = s.handle(dict(self.share_request))
            for holder, token in zip(reply["to"], reply["tokens"]):
                self.held[holder][f"{c}/{FIRST}"] = token
        self.neighbours = {c: set(v) for c, v in graph.neighbours(self.ids, num_shares=num_shares, seed=EPOCH).items()}
        self.setup = self.stages["0"].state_dict()[FED]["epochs"][EPOCH]["setup_digest"]  # what every signature binds
        self.code = FieldCode(bits=BITS, clip=1.0, max_weight=1000, clusters=n)
        # each cluster's mask key of a round as the server names it: [round] in the first (the setup's `s` key), then
        # [round, pk, signature] as the cluster published it
        self.named: dict[str, list[Any]] = {c: [FIRST] for c in self.ids}
        self.public: dict[str, str] = {f"{c}/{FIRST}": self.keys[c]["s-pk"] for c in self.ids}  # key id -> public half
        self.known_keys: dict[str, bytes] = {}  # key id -> private half, rebuilt in the rounds settled so far
        self.round = 0
        self.history: list[Settled] = []
        self.calls = 0
        self.mask_round(absent=absent)

    # -- a round ----------------------------------------------------------------------------------------
    def train_config(self, c: str) -> dict[str, Any]:
        """The train message cluster `c` got this round (as the honest server words it)."""
        return dict(self.configs[c])

    def _config(self, c: str) -> dict[str, Any]:
        named = {m: self.named[m] for m in self.ids if m == c or m in self.neighbours[c]}
        return {"federation-id": FED, "secagg-epoch": EPOCH, "server-round": self.round, "secagg-round-set": self.ids,
                "secagg-bits": BITS, "secagg-clip": 1.0, "secagg-max-weight": 1000,
                "secagg-keys": json.dumps(named, sort_keys=True),
                "secagg-key-from": list(self.held[c]), "secagg-key-tokens": list(self.held[c].values())}

    def _take_key(self, c: str, publication: dict[str, Any]) -> None:
        """Cluster `c`'s mask key of a round, as its upload of the round before (or a next-key reply) publishes it:
        named for that round, its shares delivered to the holders on their next train message."""
        seq = int(publication["seq"])
        self.named[c] = [seq, publication["pk"], publication["sig"]]
        self.public[f"{c}/{seq}"] = publication["pk"]
        for holder, token in zip(publication["to"], publication["tokens"]):
            self.held[holder][f"{c}/{seq}"] = token

    def mask_round(self, *, absent: Iterable[str] = ()) -> None:
        """The next round: every cluster but `absent` trains and uploads; then the server starts lying."""
        self.round += 1
        for c in self.ids:  # as the honest server: a key the last upload did not bring is asked for (next-key)
            if not self.rotate:
                self.named[c] = [self.round]
                self.public[f"{c}/{self.round}"] = self.keys[c]["s-pk"]
            elif self.named[c][0] != self.round:
                self._take_key(c, self.stages[c].handle({"stage": "next-key", "federation-id": FED, "epoch": EPOCH,
                                                         "round": self.round}))
        self.uploaders = [c for c in self.ids if c not in set(absent)]
        self.weights = {c: int(self.rng.integers(1, 50)) for c in self.ids}
        self.updates = {c: self.rng.normal(0, 0.05, COORDS) for c in self.ids}
        self.used = {c: (int(k[0]), self.public[f"{c}/{int(k[0])}"]) for c, k in self.named.items()}
        self.configs = {c: self._config(c) for c in self.ids}
        self.uploads: dict[str, tuple[np.ndarray, dict[str, Any]]] = {}
        for c in self.uploaders:
            stage = self.stages[c]
            plan = stage.prepare(self.train_config(c))
            self.held[c] = {}  # delivered
            masked, head = unpack_upload(stage.mask(plan, values=self.updates[c], weight=self.weights[c]))
            self.uploads[c] = (ff.unpack(masked, bits=BITS, count=COORDS + 1), head)
        for c, (_, head) in self.uploads.items():
            if "next-key" in head:  # absent only where keys do not rotate (the control of test_secagg_adversary)
                self._take_key(c, head["next-key"])
        self.receipts = {c: [digest(h, ff.pack(v, bits=BITS)), h["receipt"], h["keys"]]
                         for c, (v, h) in self.uploads.items()}
        self.snapshot = {c: s.state_dict() for c, s in self.stages.items()}
        self._memo: dict[Any, Reveal] = {}
        self._sigs: dict[tuple[str, frozenset[str]], str | None] = {}
        self._rebuilt: dict[tuple[str, str], bytes | None] = {}
        self._shares: dict[tuple[str, str, str], bytes] = {}
        self.rebuilt_keys: dict[str, bytes] = {}

    def honest(self) -> dict[str, Any]:
        """What an honest server tells everyone: the full view, or the true survivors."""
        survivors = frozenset(self.uploaders)
        return {c: FAST if len(survivors) == self.n else survivors for c in self.uploaders}

    def settle_honestly(self, *, absent: Iterable[str] = ()) -> None:
        """End this round as an honest server does (on the live stages, which remember it) and mask the next."""
        reveals = self.run(self.honest())
        for c, stage in self.stages.items():
            self.snapshot[c] = stage.state_dict()  # the honest round's promises stay with each stage
        seeds, pairs = self.knowledge(reveals)
        assert set(seeds) == set(self.uploaders), "the honest server could not unmask the honest round"
        self.known_keys.update(self.rebuilt_keys)
        self.history.append(Settled(self.round, {c: v for c, (v, _) in self.uploads.items()}, seeds, pairs,
                                    self.updates, self.weights, dict(self.used)))
        self.mask_round(absent=absent)

    # -- talking to the real stages ------------------------------------------------------------------
    def fresh(self, c: str) -> SecAggStage:
        stage = self.stages[c]
        stage.load_state_dict(self.snapshot[c])
        return stage

    def base(self, survivors: Iterable[str]) -> dict[str, Any]:
        survivors = sorted(survivors)
        return {"federation-id": FED, "epoch": EPOCH, "round": self.round, "survivors": survivors,
                "dropped": sorted(set(self.ids) - set(survivors))}

    def forwarded(self, holder: str, survivors: Iterable[str]) -> dict[str, Any]:
        senders = [s for s in sorted(survivors) if s in self.uploads and holder in self.uploads[s][1]["tokens"]]
        return {"from": senders, "tokens": [self.uploads[s][1]["tokens"][holder] for s in senders]}

    def ask(self, stage: SecAggStage, request: dict[str, Any], into: Reveal) -> dict[str, Any] | None:
        self.calls += 1
        try:
            return stage.handle(request)
        except SecAggRefusal as err:
            into.refusals.append(f"{request['stage']}: {err}")
            return None

    def signature(self, member: str, survivors: frozenset[str]) -> str | None:
        """`member`'s signature of survivor set `survivors` (from its post-upload state), or None if it refuses."""
        key = (member, survivors)
        if key not in self._sigs:
            reply = self.ask(self.fresh(member), {**self.base(survivors), "stage": "view"}, Reveal())
            self._sigs[key] = None if reply is None else reply["signature"]
        return self._sigs[key]

    def reveal(self, holder: str, choice: Any, signers: frozenset[str] = frozenset()) -> Reveal:
        """What `holder` reveals when told `choice` (FAST or a survivor set) with `signers`' signatures."""
        key = (holder, choice, signers)
        if key in self._memo:
            return self._memo[key]
        out, stage = Reveal(), self.fresh(holder)
        survivors = frozenset(self.ids) if choice == FAST else choice
        request = {**self.base(survivors), **self.forwarded(holder, survivors), "stage": "unmask",
                   "receipts": json.dumps(self.receipts)}  # every request carries every receipt the server holds
        if choice != FAST:
            self.ask(stage, {**self.base(survivors), "stage": "view"}, out)
            sigs = {m: self.signature(m, choice) for m in signers}
            request["signatures"] = json.dumps({m: s for m, s in sigs.items() if s is not None})
        reply = self.ask(stage, request, out)
        if reply is not None:
            out.self_shares = {c: _b64(v) for c, v in zip(reply["self-from"], reply["self-shares"])}
            out.pair_keys = {c: _b64(v) for c, v in zip(reply["pair-with"], reply["pair-keys"])}
        dropped = sorted((set(self.ids) - survivors) & self.neighbours[holder])
        if dropped:  # asked whatever the unmask answered: a signature alone must not release key shares
            got = self.ask(stage, {"federation-id": FED, "epoch": EPOCH, "stage": "recover", "round": self.round,
                                   "clusters": dropped}, out)
            if got is not None:
                out.key_shares = {k: _b64(v) for k, v in zip(got["key-ids"], got["key-shares"])}
        self._memo[key] = out
        return out

    def run(self, schedule: dict[str, Any]) -> dict[str, Reveal]:
        """Every told cluster's reveals under `schedule` (cluster -> FAST or survivor set)."""
        assigned: dict[Any, set[str]] = {}
        for c, choice in schedule.items():
            assigned.setdefault(choice, set()).add(c)
        return {c: self.reveal(c, choice, frozenset() if choice == FAST else frozenset(assigned[choice]))
                for c, choice in schedule.items()}

    # -- the oracle ------------------------------------------------------------------------------------
    def _secret(self, kind: str, whose: str, pieces: dict[str, bytes]) -> bytes | None:
        """The secret `pieces` rebuild (with Flower's Shamir, checked as the server checks it), or None.

        A holder's share of a secret is the same bytes in every schedule (asserted), so any `t` of them
        rebuild the same secret: it is rebuilt once, and fewer than `t` shares never count."""
        for holder, piece in pieces.items():
            assert self._shares.setdefault((kind, whose, holder), piece) == piece, "a holder's share changed"
        if len(pieces) < self.t:
            return None
        if (kind, whose) not in self._rebuilt:
            if kind == "self":
                commit = self.uploads[whose][1]["commit"]["self"]
                check: Callable[[bytes], bool] = lambda s: commitment(s) == commit  # noqa: E731
            else:  # `whose` is a mask key's id, owner/number: its public half was published
                pk = self.public[whose].encode()
                check = lambda s: shares.matches_public(s, pk)  # noqa: E731
            group = {h: pieces[h] for h in sorted(pieces)[: self.t]}
            try:
                self._rebuilt[(kind, whose)] = rebuild(group, threshold=self.t, check=check)[0]
            except ShareError:
                self._rebuilt[(kind, whose)] = None
        return self._rebuilt[(kind, whose)]

    def knowledge(self, reveals: dict[str, Reveal]) -> tuple[dict[str, bytes], dict[frozenset[str], bytes]]:
        """(self-mask seeds the server rebuilds, this round's pair keys it knows) from every reveal together, and
        from every mask key rebuilt now or in an earlier round (`rebuilt_keys`: this round's)."""
        seeds, pairs = {}, {}
        for whose in self.uploaders:
            pieces = {h: r.self_shares[whose] for h, r in reveals.items() if whose in r.self_shares}
            if (seed := self._secret("self", whose, pieces)) is not None:
                seeds[whose] = seed
        for holder, r in reveals.items():
            for other, key in r.pair_keys.items():
                pairs[frozenset((holder, other))] = key
        for kid in sorted({k for r in reveals.values() for k in r.key_shares}):
            pieces = {h: r.key_shares[kid] for h, r in reveals.items() if kid in r.key_shares}
            if (pem := self._secret("key", kid, pieces)) is not None:
                self.rebuilt_keys[kid] = pem
        pairs.update(self.derived(self.used, self.round))
        return seeds, pairs

    def derived(self, used: dict[str, tuple[int, str]], server_round: int) -> dict[frozenset[str], bytes]:
        """The pair keys of `server_round` (masked with the keys `used`) that the mask keys the server rebuilt, in
        this round or any earlier one, give it: ECDH of a rebuilt private half with the other side's public key
        of that round, and both key numbers."""
        rebuilt = {self.public[kid]: pem for kid, pem in {**self.known_keys, **self.rebuilt_keys}.items()}
        out = {}
        for whose in self.ids:
            seq, pk = used[whose]
            if pk not in rebuilt:
                continue
            for other in self.neighbours[whose]:
                their_seq, their_pk = used[other]
                secret = shares.pair_secret(rebuilt[pk], their_pk.encode())
                out[frozenset((whose, other))] = round_key(secret, epoch=EPOCH, server_round=server_round,
                                                           seqs=pair_order(whose, other, seq, their_seq))
        return out

    def exposed(self, reveals: dict[str, Reveal], *, below: int | None = None) -> list[tuple[int, tuple[str, ...]]]:
        """Every (round, set of fewer than `below` clusters) whose sum the server can compute (and does, checked)."""
        below = self.t if below is None else below
        self.rebuilt_keys: dict[str, bytes] = {}
        seeds, pairs = self.knowledge(reveals)
        rounds = [(self.round, {c: v for c, (v, _) in self.uploads.items()}, seeds, pairs, self.updates, self.weights)]
        self.rechecked: list[tuple[int, int]] = []  # (earlier round, its pair keys only keys rebuilt since give)
        for old in self.history:  # a key rebuilt now unmasks every round it masked
            known = dict(old.pairs)
            fresh = {p: k for p, k in self.derived(old.keys, old.number).items() if p not in known}
            self.rechecked.append((old.number, len(fresh)))
            rounds.append((old.number, old.uploads, old.seeds, {**known, **fresh}, old.updates, old.weights))
        found = []
        for number, uploads, seeds_, pairs_, updates, weights in rounds:
            for size in range(1, below):
                for group in itertools.combinations(sorted(seeds_, key=int), size):
                    if unmask(group, uploads=uploads, seeds=seeds_, pairs=pairs_, neighbours=self.neighbours,
                              code=self.code, updates=updates, weights=weights) is not None:
                        found.append((number, group))
        return found


def unmask(group: Iterable[str], *, uploads: dict[str, np.ndarray], seeds: dict[str, bytes],
           pairs: dict[frozenset[str], bytes], neighbours: dict[str, set[str]], code: FieldCode,
           updates: dict[str, np.ndarray], weights: dict[str, int]) -> np.ndarray | None:
    """Σ_group w·x as the server would compute it from what it knows, checked against the truth; None if it cannot."""
    group = set(group)
    if not group <= set(seeds):
        return None
    orphans = []
    for c in group:
        for other in neighbours[c] - group:
            key = pairs.get(frozenset((c, other)))
            if key is None:
                return None
            orphans.append((pair_sign(c, other), key))
    total = np.zeros(COORDS + 1, dtype=np.uint64)
    for c in group:
        total = ff.add(total, uploads[c], code=code)
    plain = remove_masks(total, code=code, self_seeds=[seeds[c] for c in group], orphan_pairs=orphans)
    weighted, weight = ff.decode_sum(plain, code=code)
    truth = sum(weights[c] * updates[c] for c in group)
    ok = weight == sum(weights[c] for c in group) and np.abs(weighted - truth).max() <= len(group) * code.step
    assert ok, f"the oracle unmasked {sorted(group)} to something that is not their sum: a bug in the oracle"
    return weighted


# -- schedules -----------------------------------------------------------------------------------------
def choices(ids: list[str], c: str) -> list[Any]:
    """What the server can tell cluster `c`: the full view, or any proper survivor set containing it."""
    others = [o for o in ids if o != c]
    return [FAST, *(frozenset((c, *extra)) for k in range(len(others)) for extra in itertools.combinations(others, k))]


def every_schedule(ids: list[str], told: list[str]) -> Iterable[dict[str, Any]]:
    """Every combination of what each cluster in `told` can be told."""
    for combo in itertools.product(*(choices(ids, c) for c in told)):
        yield dict(zip(told, combo))


def schedules_with_views(ids: list[str], told: list[str], *, views: int) -> Iterable[dict[str, Any]]:
    """Every schedule with at most `views` distinct survivor sets, each cluster told one containing it or the
    full view."""
    proper = [frozenset(s) for k in range(1, len(ids)) for s in itertools.combinations(ids, k)]
    seen = set()
    for chosen in itertools.combinations(proper, views):
        for combo in itertools.product(*([FAST, *(v for v in chosen if c in v)] for c in told)):
            if combo not in seen:
                seen.add(combo)
                yield dict(zip(told, combo))


def splits(ids: list[str], told: list[str]) -> Iterable[dict[str, Any]]:
    """Every split of the clusters into two camps A and B: A told "B dropped" while B is told nobody did, and A
    told "B dropped" while B is told "A dropped"."""
    for k in range(1, len(ids)):
        for camp in map(frozenset, itertools.combinations(ids, k)):
            rest = frozenset(ids) - camp
            yield {c: camp if c in camp else FAST for c in told}
            yield {c: camp if c in camp else rest for c in told}


def random_schedules(ids: list[str], told: list[str], *, count: int, seed: int) -> Iterable[dict[str, Any]]:
    """`count` schedules with 1 to 3 survivor sets drawn at random, each cluster told one containing it or the
    full view."""
    rng = np.random.default_rng(seed)
    for _ in range(count):
        views = [frozenset(rng.choice(ids, size=int(rng.integers(1, len(ids))), replace=False).tolist())
                 for _ in range(int(rng.integers(1, 4)))]
        yield {c: ([v for v in views if c in v] + [FAST])[int(rng.integers(0, 1 + sum(c in v for v in views)))]
               for c in told}


def the_reported_attack(ids: list[str], target: str) -> dict[str, Any]:
    """The attack this defence answers: the target is told everyone else dropped, the rest that nobody did."""
    return {c: frozenset({target}) if c == target else FAST for c in ids}


# -- campaigns -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Campaign:
    name: str
    n: int
    threshold: int
    schedules: str  # "every", "views:K", "splits" or "random:COUNT"
    num_shares: int = 0
    absent: tuple[str, ...] = ()  # clusters that really drop out before uploading
    after_honest_round: bool = False  # the epoch has an honestly unmasked round before the one attacked

    def epoch(self, tmp: Path) -> Epoch:
        ep = Epoch(tmp, n=self.n, threshold=self.threshold, num_shares=self.num_shares, seed=self.n * 100 + self.threshold,
                   absent=() if self.after_honest_round else self.absent)
        if self.after_honest_round:
            ep.settle_honestly(absent=self.absent)
        return ep

    def play(self, ep: Epoch) -> Iterable[dict[str, Any]]:
        kind, _, arg = self.schedules.partition(":")
        told = ep.uploaders
        yield from (the_reported_attack(told, t) for t in told)
        if kind == "every":
            yield from every_schedule(ep.ids, told)
        elif kind == "views":
            yield from schedules_with_views(ep.ids, told, views=int(arg))
        elif kind == "splits":
            yield from splits(ep.ids, told)
        else:
            yield from random_schedules(ep.ids, told, count=int(arg), seed=ep.n)


CAMPAIGNS = [
    Campaign("n=3 t=2, every schedule", 3, 2, "every"),
    Campaign("n=3 t=3, every schedule", 3, 3, "every"),
    Campaign("n=4 t=3, every schedule", 4, 3, "every"),
    Campaign("n=4 t=4, every schedule", 4, 4, "every"),
    Campaign("n=4 t=3, after an honest round, every schedule", 4, 3, "every", after_honest_round=True),
    Campaign("n=5 t=3, up to 2 survivor sets", 5, 3, "views:2"),
    Campaign("n=5 t=4, up to 2 survivor sets", 5, 4, "views:2"),
    Campaign("n=5 t=5, up to 2 survivor sets", 5, 5, "views:2"),
    Campaign("n=5 t=3, cluster 4 really dropped, up to 2 survivor sets", 5, 3, "views:2", absent=("4",)),
    Campaign("n=5 t=3, after an honest round, up to 2 survivor sets", 5, 3, "views:2", after_honest_round=True),
    Campaign("n=8 t=5, every split into two camps", 8, 5, "splits"),
    Campaign("n=8 t=5, 1,000 random schedules", 8, 5, "random:1000"),
    Campaign("n=8 t=6, 500 random schedules", 8, 6, "random:500"),
    Campaign("n=8 t=3 of 5 holders (SecAgg+ graph), every split into two camps", 8, 3, "splits", num_shares=5),
    Campaign("n=8 t=3 of 5 holders (SecAgg+ graph), 1,000 random schedules", 8, 3, "random:1000", num_shares=5),
]


def play(campaign: Campaign, tmp: Path) -> tuple[int, list[tuple[dict[str, Any], list[tuple[int, tuple[str, ...]]]]]]:
    """(schedules tried, [(schedule, what it exposed)] for every schedule that exposed anything)."""
    ep = campaign.epoch(tmp)
    tried, bad = 0, []
    for schedule in campaign.play(ep):
        tried += 1
        found = ep.exposed(ep.run(schedule))
        if found:
            bad.append((schedule, found))
    return tried, bad


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="A lying server against real cluster stages: sums of fewer than t clusters recovered")
    for col in ("campaign", "schedules", "recovered", "seconds"):
        table.add_column(col, justify="left" if col == "campaign" else "right")
    total_tried = total_bad = 0
    for campaign in CAMPAIGNS:
        started = time.monotonic()
        with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as tmp:
            tried, bad = play(campaign, Path(tmp))
        total_tried, total_bad = total_tried + tried, total_bad + len(bad)
        table.add_row(campaign.name, f"{tried:,}", str(len(bad)), f"{time.monotonic() - started:.1f}")
    table.add_row("all", f"{total_tried:,}", str(total_bad), "")
    Console().print(table)


if __name__ == "__main__":
    main()
