"""The cluster's side of secure aggregation: its keys, the shares it holds, masking, and what it reveals.

Lives on rank 0 beside the privacy gate, so only masked vectors leave the cluster. Requests come from the
server (through the ClientApp): `keys` (a new epoch: two fresh EC key pairs, public halves out, signed
with the cluster's identity key: `c` seals shares for the whole epoch, `s` is the mask key of the epoch's
first round), `share` (the epoch's members, their keys and signatures, checked against the roster; that
mask key is Shamir-shared among the neighbours and itself, each share sealed to its holder), then per round the masking of the update:
the train request carries the epoch, the round set, the mask key each neighbour in the round masks with
(signed by its owner) and the shares of neighbours' keys sealed to this cluster; the upload carries
commitments, a signed receipt naming the keys used, and this cluster's mask key of the next round (its
public half signed with that round, its private half shared and sealed): a mask key masks one round (reveal.py, rule 0), at no extra
trip. Then `view` (only in a round with dropouts: sign the survivor set, once), `unmask` (self-mask shares
of survivors, pair keys with clusters that dropped, on the evidence reveal.py demands; with round-overlap
it rides on the next round's train message and its answer on that round's reply: `answer_riding`) and,
rarely, `recover` (shares of the keys dropped clusters were to mask a round with) and `next-key` (this
cluster's key of a round, for a server that lacks it: the cluster was not in the round before, or the upload
carrying it never came). `secagg/reveal.py` holds every
rule and why it is enough. The state (private keys included) is a 0600 JSON file in the state folder,
written before any reply leaves, so a restarted trainer keeps its keys and its promises.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from nebula_fl.clients.reply_cache import FEDERATION_ID
from nebula_fl.errors import NebulaError
from nebula_fl.secagg import evidence, field, graph, shares
from nebula_fl.secagg.field import FieldCode, FieldError
from nebula_fl.secagg.identity import Identity, check_public, load_roster, verify
from nebula_fl.secagg.masking import mask_input
from nebula_fl.secagg.masks import pair_order, pair_sign, round_key
from nebula_fl.secagg.reveal import RevealLog, key_id, refuse_keys, refuse_recover, refuse_unmask, refuse_view
from nebula_fl.secagg.shares import KeyPair, ShareError
from nebula_fl.secagg.wire import commitment, digest, pack_upload

EPOCH_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
KEPT_EPOCHS = 2
KEPT_ROUNDS = 8
KEPT_KEYS = KEPT_ROUNDS + 1  # own used mask keys kept, newest rounds (a dropout round asks for their pair keys)
FUTURE_KEYS = 4  # own unused keys of rounds ahead, at most: asking for more is refused, never pruned into a key in use
KEPT_KEY_SHARES = 64  # neighbours' mask-key shares kept, newest numbers first
STATE_VERSION = 3  # state of an older layout is set aside: its epochs are unknown, so the server re-keys


class SecAggRefusal(NebulaError):
    """A secure-aggregation request this cluster refuses (the reason goes back to the server and the log)."""


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text.encode(), validate=True)


@dataclass(frozen=True, kw_only=True)
class Requirement:
    """The operator's demand (privacy policy): every update leaves masked, in sums this large or larger."""

    min_threshold: int = 2
    """The fewest clusters whose sum the server may unmask (the epoch's threshold must be at least this)."""
    min_clusters: int = 2
    """The fewest clusters masked together in a round."""

    def __post_init__(self) -> None:
        if not 2 <= self.min_threshold <= self.min_clusters:
            raise ValueError(f"a secure-aggregation requirement needs 2 <= min threshold ({self.min_threshold}) <= "
                             f"min clusters ({self.min_clusters})")


@dataclass(frozen=True, kw_only=True)
class RoundPlan:
    """What the train request of a secure round fixed, checked before training."""

    federation: str
    epoch: str
    server_round: int
    round_set: tuple[str, ...]
    code: FieldCode
    threshold: int
    keys: dict[str, tuple[int, str]]
    """Member -> (number, public key) of the mask key it masks this round with: this cluster and its neighbours."""


def _members(value: Any, what: str) -> set[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value) or len(set(value)) != len(value):
        raise SecAggRefusal(f"the request's {what} are not a list of distinct cluster ids")
    return set(value)


def _check_federation(federation: Any) -> None:
    """A federation id names this cluster's state file: never let the server pick a path."""
    if not isinstance(federation, str) or not FEDERATION_ID.fullmatch(federation):
        raise SecAggRefusal(f"federation id {federation!r} is not a plain name of letters, digits, '-' and '_'")


def _check_ids(federation: Any, epoch: Any) -> None:
    _check_federation(federation)
    if not isinstance(epoch, str) or not EPOCH_ID.fullmatch(epoch):
        raise SecAggRefusal(f"epoch {epoch!r} is not an epoch id (1 to 64 letters, digits, '-' and '_')")


def _round_number(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SecAggRefusal(f"round {value!r} is not a round number")
    return value


class SecAggStage:
    def __init__(self, *, state_dir: Path, cluster_id: int, roster: dict[str, str] | None = None,
                 requirement: Requirement | None = None, trust_server_membership: bool = False,
                 rotate_keys: bool = True) -> None:
        self.me = str(cluster_id)
        self.folder = state_dir / "secagg"
        self.roster, self.requirement = roster, requirement
        self.trust_server_membership = trust_server_membership  # without a roster: the operator's explicit opt-out
        # False only in the adversary campaign's control: one mask key for every round of an epoch, the layout
        # whose multi-round attack the campaign must find (tests/test_secagg_campaign.py)
        self.rotate_keys = rotate_keys
        if roster is not None and trust_server_membership:
            raise NebulaError("a roster and trust in the server's membership exclude each other; drop "
                              "--secagg-trust-server-membership (the roster says who the members are)")
        self.lock = threading.Lock()
        self.states: dict[str, dict[str, Any]] = {}  # federation -> its state
        self._identity: Identity | None = None
        if roster is not None and self.me not in roster:
            raise NebulaError(f"the roster does not list cluster {self.me} (this one); add the line `nebula-fl identity` "
                              "prints for it, as every other cluster's roster has")
        if roster is not None and roster[self.me] != self.identity.public:
            raise NebulaError(f"the roster lists another identity key for cluster {self.me} than this state folder's "
                              f"({self.folder}); fix the roster line or use this cluster's own state folder")

    @classmethod
    def for_policy(cls, *, state_dir: Path, cluster_id: int, policy: Any) -> SecAggStage:
        """The stage a cluster's privacy policy sets up: its roster (`secagg_peers`) or its operator's trust in the
        server's membership, and its requirement, if any."""
        roster = load_roster(policy.secagg_peers) if policy.secagg_peers else None
        requirement = (Requirement(min_threshold=policy.secagg_threshold, min_clusters=policy.secagg_clusters)
                       if policy.require_secure_aggregation else None)
        return cls(state_dir=state_dir, cluster_id=cluster_id, roster=roster, requirement=requirement,
                   trust_server_membership=policy.secagg_trust_server_membership)

    def describe(self) -> str:
        """One phrase for the trainer's start line."""
        need = ("no requirement" if self.requirement is None else
                f"required, in sums of at least {self.requirement.min_threshold} of at least "
                f"{self.requirement.min_clusters} clusters")
        who = (f"roster of {len(self.roster)} clusters" if self.roster is not None else
               "no roster, membership: the server's word (--secagg-trust-server-membership), so a lying server "
               "could add members of its own" if self.trust_server_membership else
               "no roster, so masked rounds are refused (give --secagg-peers)")
        return f"secure aggregation: {need}, {who}"

    def requirement_refusal(self, config: dict[str, Any]) -> str | None:
        """Why this cluster's policy refuses the round as the server asks it (unmasked, or masked too weakly)."""
        need = self.requirement
        if need is None:
            return None
        if "secagg-epoch" not in config:
            return ("this cluster's policy requires secure aggregation and the server asks for an unmasked update; "
                    "run the federation with --secure-aggregation (secagg.enabled=true)")
        try:
            _check_ids(config.get("federation-id"), config.get("secagg-epoch"))
        except SecAggRefusal:
            return None  # not a round at all: prepare() refuses it
        with self.lock:
            e = self._state(config["federation-id"])["epochs"].get(config["secagg-epoch"], {})
        threshold, round_set = e.get("threshold"), config.get("secagg-round-set")
        if isinstance(threshold, int) and threshold < need.min_threshold:
            return (f"the server's secure aggregation unmasks sums of {threshold} clusters; this cluster's policy "
                    f"requires at least {need.min_threshold} (raise secagg.threshold)")
        if isinstance(round_set, list) and len(round_set) < need.min_clusters:
            return (f"the server masks {len(round_set)} clusters together; this cluster's policy requires at least "
                    f"{need.min_clusters}")
        return None

    def membership_refusal(self) -> str | None:
        """Why this cluster joins no key setup or masked round: with no roster, the server alone would say who the
        members are, and one that invents the others reads this cluster's update from its upload alone."""
        if self.roster is not None or self.trust_server_membership:
            return None
        return (f"cluster {self.me} has no roster of secure-aggregation peers, so the server alone would name the "
                "members; give its trainer --secagg-peers FILE (the lines `nebula-fl identity` prints on each "
                "cluster), or opt out with --secagg-trust-server-membership")

    @property
    def identity(self) -> Identity:
        if self._identity is None:
            self._identity = Identity.load_or_create(self.folder)
        return self._identity

    # -- state -------------------------------------------------------------------------------------
    def _path(self, federation: str) -> Path:
        return self.folder / f"{federation}.json"

    def _state(self, federation: str) -> dict[str, Any]:
        _check_federation(federation)
        if federation not in self.states:
            path = self._path(federation)
            state = json.loads(path.read_text()) if path.exists() else {}
            if state.get("version") != STATE_VERSION:
                state = {"version": STATE_VERSION, "epochs": {}, "rounds": {}}
            self.states[federation] = state
        return self.states[federation]

    def _save(self, federation: str) -> None:
        """Written and fsynced before the reply leaves: what was revealed is never forgotten."""
        state = self._state(federation)
        epochs = sorted(state["epochs"], key=lambda e: state["epochs"][e]["created"])
        for old in epochs[:-KEPT_EPOCHS]:
            del state["epochs"][old]
        for old in sorted(state["rounds"], key=lambda r: state["rounds"][r]["created"])[:-KEPT_ROUNDS]:
            del state["rounds"][old]
        self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = self._path(federation).with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(json.dumps(state))  # json.dump streams through the pure-Python encoder: 3x slower
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, self._path(federation))

    def state_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(self.states))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.states = json.loads(json.dumps(state))

    def _epoch(self, federation: str, epoch: str) -> dict[str, Any]:
        found = self._state(federation)["epochs"].get(epoch)
        if found is None:
            raise SecAggRefusal(f"secure aggregation epoch {epoch!r} is unknown to cluster {self.me}; "
                                "the server must set up keys again")
        return found

    def _set_up(self, federation: str, epoch: str) -> dict[str, Any]:
        e = self._epoch(federation, epoch)
        if "setup" not in e:
            raise SecAggRefusal(f"epoch {epoch} has no shares yet; the server must finish its setup")
        return e

    # -- requests from the server ------------------------------------------------------------------
    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        """One setup or unmasking request; returns the reply (raises SecAggRefusal with the reason)."""
        if request.get("stage") in ("keys", "share") and (why := self.membership_refusal()):
            raise SecAggRefusal(why)
        stage, federation, epoch = request.get("stage"), request.get("federation-id"), request.get("epoch")
        _check_ids(federation, epoch)
        handlers = {"keys": self._keys, "share": self._share, "view": self._view, "unmask": self._unmask,
                    "recover": self._recover, "next-key": self._next_key}
        if not isinstance(stage, str) or stage not in handlers:
            raise SecAggRefusal(f"unknown secure-aggregation stage {stage!r}")
        with self.lock:
            return handlers[stage](federation, epoch, request)

    def answer_riding(self, request: Any) -> dict[str, Any]:
        """The answer to an unmask request that rode on a train message (round-overlap: round r's request on
        round r+1's message), to ride back in that round's reply: `handle`'s reply, or {"refused": why}.

        The very checks of an explicit request (it goes through `handle`: view rules, evidence, one view per
        round, a replay answered with its first answer); only the `unmask` stage may ride: setup, view and
        recover requests keep their own trip. Answered whatever becomes of the round it rode on (refused by the
        privacy gate or the policy, or failed): the answer is the stage's, kept in its state before it leaves."""
        if not isinstance(request, dict) or request.get("stage") != "unmask":
            stage = request.get("stage") if isinstance(request, dict) else None
            return {"refused": f"only an unmask request may ride on a train message, not {stage!r}"}
        try:
            return self.handle(request)
        except (SecAggRefusal, ValueError, KeyError, TypeError) as err:
            return {"refused": f"secure aggregation (unmask): {err}"}

    def _keys(self, federation: str, epoch: str, request: dict[str, Any]) -> dict[str, Any]:
        """Two fresh key pairs for a new epoch: `c` seals shares all epoch, `s` is the mask key of the epoch's
        first round (`round`), and the signature binds it to that round (reveal.py, rule 0)."""
        first = _round_number(request.get("round"))
        epochs = self._state(federation)["epochs"]
        if epoch not in epochs:  # a replayed request gets the same keys, never a second pair for one epoch
            c, s = KeyPair.generate(), KeyPair.generate()
            epochs[epoch] = {"created": max((e["created"] for e in epochs.values()), default=-1) + 1,
                             "first_round": first, "c_sk": c.private_pem.decode(), "c_pk": c.public.decode(),
                             "s_sk": s.private_pem.decode(), "s_pk": s.public.decode()}
            self._save(federation)
        e = epochs[epoch]
        if e["first_round"] != first:
            raise SecAggRefusal(f"epoch {epoch}'s keys were made for round {e['first_round']}, not {first}")
        return {"c-pk": e["c_pk"], "s-pk": e["s_pk"], "id-pk": self.identity.public,
                "key-sig": self.identity.sign("keys", federation, epoch, self.me, e["c_pk"], e["s_pk"], first)}

    def _identities(self, members: list[str], offered: list[Any]) -> dict[str, str]:
        """Each member's identity key: the roster's, or (without a roster) the one the server forwarded."""
        if self.roster is not None:
            strangers = [m for m in members if m not in self.roster]
            if strangers:
                raise SecAggRefusal(f"cluster(s) {strangers} are not on this cluster's roster of peers; the server "
                                    "cannot add members of its own")
            return {m: self.roster[m] for m in members}
        try:
            return {m: check_public(k) for m, k in zip(members, offered)}
        except (ValueError, TypeError) as err:
            raise SecAggRefusal(f"a member's identity key is invalid: {err}") from None

    def _share(self, federation: str, epoch: str, request: dict[str, Any]) -> dict[str, Any]:
        e = self._epoch(federation, epoch)
        members, c_pks, s_pks = request.get("members"), request.get("c-pks"), request.get("s-pks")
        id_pks, sigs = request.get("id-pks"), request.get("key-sigs")
        if not (isinstance(members, list) and all(isinstance(v, list) for v in (c_pks, s_pks, id_pks, sigs))
                and len(members) == len(c_pks) == len(s_pks) == len(id_pks) == len(sigs)
                and all(isinstance(m, str) for m in members) and all(isinstance(k, str) for k in c_pks + s_pks)):
            raise SecAggRefusal("the share request's members, public keys and signatures do not line up")
        setup = evidence.setup_record(members=members, c_pks=c_pks, s_pks=s_pks, id_pks=id_pks, sigs=sigs,
                                      num_shares=request.get("num-shares"), threshold=request.get("threshold"),
                                      first_round=request.get("round"))
        if "setup" in e:  # a replay: the same answer, or a refusal if the server changed anything
            if e["setup"] != setup:
                raise SecAggRefusal(f"epoch {epoch} was set up already with other members or keys")
            return {"to": list(e["tokens"]), "tokens": list(e["tokens"].values())}
        if self.me not in members or len(set(members)) != len(members):
            raise SecAggRefusal(f"cluster {self.me} is not once among the epoch's members {members}")
        mine = members.index(self.me)
        if request.get("round") != e["first_round"]:
            raise SecAggRefusal(f"the share request is for round {request.get('round')!r}; this cluster's keys for "
                                f"epoch {epoch} were made for round {e['first_round']}")
        if (c_pks[mine], s_pks[mine]) != (e["c_pk"], e["s_pk"]):
            raise SecAggRefusal("the server lists other public keys for this cluster than the ones it gave")
        if len(set(c_pks)) != len(c_pks) or len(set(s_pks)) != len(s_pks):
            raise SecAggRefusal("two members of the epoch share a public key")
        ids = self._identities(members, id_pks)
        forged = [m for m, c, s, sig in zip(members, c_pks, s_pks, sigs)
                  if not verify(ids[m], sig, "keys", federation, epoch, m, c, s, e["first_round"])]
        if forged:
            raise SecAggRefusal(f"the keys the server lists for cluster(s) {forged} are not signed by their identity "
                                "keys: forged or altered on the way")
        num_shares, threshold = setup["num_shares"], setup["threshold"]
        if isinstance(num_shares, bool) or not isinstance(num_shares, int) or num_shares < 0:
            raise SecAggRefusal(f"num-shares {num_shares!r} is not a count")
        nbrs_of = graph.neighbours(members, num_shares=num_shares, seed=epoch)
        nbrs = nbrs_of[self.me]
        holders = len(nbrs) + 1
        if isinstance(threshold, bool) or not isinstance(threshold, int) or not (2 <= threshold <= holders
                                                                                 and 2 * threshold > holders):
            raise SecAggRefusal(f"threshold {threshold!r} for {holders} share holders: it must be at least 2 and more "
                                "than half of them, or one group could rebuild a self mask and another the key")
        try:
            for i in range(len(members)):
                shares.check_public(c_pks[i].encode())
                shares.check_public(s_pks[i].encode())
        except ShareError as err:
            raise SecAggRefusal(f"a member's public key is invalid: {err}") from None
        e["own_key_share"], tokens = self._share_out(
            e, e["s_sk"].encode(), others=nbrs, threshold=threshold, setup=setup,
            header={"kind": "key", "epoch": epoch, "seq": e["first_round"]})
        e.update(setup=setup, setup_digest=evidence.setup_digest(setup), ids=ids,
                 graph={m: list(v) for m, v in nbrs_of.items()}, neighbours=list(nbrs), threshold=threshold,
                 tokens=tokens, key_shares={}, log=RevealLog().state_dict(),
                 mask_keys={str(e["first_round"]): {"sk": e["s_sk"], "pk": e["s_pk"], "sig": "", "round": None,
                                                    "own_share": e["own_key_share"], "tokens": tokens}})
        self._save(federation)
        return {"to": list(tokens), "tokens": list(tokens.values())}

    def _share_out(self, e: dict[str, Any], secret: bytes, *, others: Sequence[str], threshold: int,
                   setup: dict[str, Any], header: dict[str, Any]) -> tuple[str, dict[str, str]]:
        """(this cluster's own share, holder -> its share sealed under `header` plus from/to): `secret` Shamir-shared
        among this cluster and `others`, any `threshold` of the shares rebuilding it."""
        pieces = shares.split(secret, threshold=threshold, holders=len(others) + 1)
        tokens = {holder: shares.seal(self._seal_key(e, holder, setup), header={**header, "from": self.me, "to": holder},
                                      share=piece).decode() for holder, piece in zip(others, pieces[1:])}
        return b64(pieces[0]), tokens

    @staticmethod
    def _seal_key(e: dict[str, Any], other: str, setup: dict[str, Any]) -> bytes:
        """The key sealing shares between this cluster and `other` (ECDH of their `c` keys)."""
        return shares.fernet_key(e["c_sk"].encode(), setup["c_pks"][setup["members"].index(other)].encode())

    # -- a secure round ----------------------------------------------------------------------------
    def prepare(self, config: dict[str, Any]) -> RoundPlan:
        """Check a secure round's train request and keep the key shares it delivers; before any training."""
        if why := self.membership_refusal():
            raise SecAggRefusal(why)
        federation, epoch, rnd = config.get("federation-id"), config.get("secagg-epoch"), config.get("server-round")
        _check_ids(federation, epoch)
        if why := self.requirement_refusal(config):  # the trainer asks first, to refuse as its policy; never skipped
            raise SecAggRefusal(why)
        with self.lock:
            e = self._set_up(federation, epoch)
            rnd = _round_number(rnd)
            round_set = config.get("secagg-round-set")
            if self.me not in _members(round_set, "round's clusters"):
                raise SecAggRefusal(f"the round's clusters {round_set!r} do not include cluster {self.me}")
            unknown = set(round_set) - set(e["setup"]["members"])
            if unknown:
                raise SecAggRefusal(f"the round names cluster(s) {sorted(unknown)} outside epoch {epoch}")
            holders = ({self.me, *e["neighbours"]}) & set(round_set)
            if len(holders) < e["threshold"]:
                raise SecAggRefusal(f"only {len(holders)} of this cluster's share holders are in the round; "
                                    f"{e['threshold']} are needed to unmask it")
            if _round_id(epoch, rnd) in self._state(str(federation))["rounds"]:
                raise SecAggRefusal(f"round {rnd} was masked already in epoch {epoch}; a round is masked once, under "
                                    "one round set")
            try:
                code = FieldCode(bits=int(config["secagg-bits"]), clip=float(config["secagg-clip"]),
                                 max_weight=int(config["secagg-max-weight"]), clusters=len(round_set))
            except (KeyError, TypeError, ValueError) as err:
                raise SecAggRefusal(f"the round's field encoding is invalid: {err}") from None
            keys = self._round_keys(e, federation=federation, epoch=epoch, server_round=rnd, round_set=set(round_set),
                                    named=evidence.json_map(config.get("secagg-keys")))
            self._deliver(e, epoch=epoch, config=config)
            self._save(federation)
            return RoundPlan(federation=federation, epoch=epoch, server_round=rnd, round_set=tuple(round_set),
                             code=code, threshold=int(e["threshold"]), keys=keys)

    def _round_keys(self, e: dict[str, Any], *, federation: str, epoch: str, server_round: int, round_set: set[str],
                    named: dict[str, Any]) -> dict[str, tuple[int, str]]:
        """Member -> (the round its key is bound to, public key) for this cluster and its neighbours in the round:
        each must be its owner's key of exactly this round (signed by the owner with the round; the epoch's first
        round: the setup's key), so a key masks one round whatever the server names (reveal.py, rule 0)."""
        own = self._own_key(e, server_round)
        if own is None:
            raise SecAggRefusal(f"cluster {self.me} has no mask key for round {server_round}; the server must ask "
                                "for one (next-key)")
        out = {self.me: (server_round, own["pk"])}
        members = e["setup"]["members"]
        for other in sorted(set(e["neighbours"]) & round_set):
            entry = named.get(other)
            if not (isinstance(entry, list) and entry and entry[0] == server_round):
                said = entry[0] if isinstance(entry, list) and entry else None
                raise SecAggRefusal(f"the server names cluster {other}'s mask key of round {said!r} for round "
                                    f"{server_round}: a mask key masks only the round it was made for")
            if server_round == e["first_round"] or not self.rotate_keys:
                pk = e["setup"]["s_pks"][members.index(other)]
            else:
                pk = entry[1] if len(entry) == 3 and isinstance(entry[1], str) else ""
                sig = entry[2] if len(entry) == 3 else None
                if not verify(e["ids"][other], sig, "mask-key", federation, epoch, e["setup_digest"], other,
                              server_round, pk):
                    raise SecAggRefusal(f"the mask key of cluster {other} for round {server_round} is not signed by "
                                        "its identity key for that round: forged, altered or made for another round")
                try:
                    shares.check_public(pk.encode())
                except ShareError as err:
                    raise SecAggRefusal(f"the mask key of cluster {other} for round {server_round} is invalid: "
                                        f"{err}") from None
            out[other] = (server_round, pk)
        return out

    def _own_key(self, e: dict[str, Any], server_round: int) -> dict[str, Any] | None:
        """This cluster's mask key of `server_round` (the control campaign's stage: the setup's key, every round)."""
        return e["mask_keys"].get(str(server_round if self.rotate_keys else e["first_round"]))

    def _deliver(self, e: dict[str, Any], *, epoch: str, config: dict[str, Any]) -> None:
        """Keep the shares of neighbours' mask keys sealed to this cluster ("owner/number" each)."""
        senders, tokens = config.get("secagg-key-from") or [], config.get("secagg-key-tokens") or []
        if not isinstance(senders, list) or not isinstance(tokens, list) or len(senders) != len(tokens):
            raise SecAggRefusal("the delivered key shares and their senders do not line up")
        for name, token in zip(senders, tokens):
            sender, _, seq = str(name).partition("/")
            if sender not in e["neighbours"] or not seq.isdigit() or name in e["key_shares"]:
                continue
            try:
                piece = shares.unseal(self._seal_key(e, sender, e["setup"]), str(token).encode(),
                                      expect={"kind": "key", "from": sender, "to": self.me, "epoch": epoch,
                                              "seq": int(seq)})
            except ShareError as err:
                raise SecAggRefusal(f"the share of mask key {name} does not open: {err}") from None
            e["key_shares"][key_id(sender, int(seq))] = b64(piece)
        held = sorted(e["key_shares"], key=lambda k: int(k.rpartition("/")[2]))
        for old in held[:-KEPT_KEY_SHARES]:  # a key masks one round: shares of long-used keys are worthless
            del e["key_shares"][old]

    def holds_keys(self, federation: str, epoch: str) -> bool:
        """Whether this cluster holds a share of some mask key of every neighbour (for the round's metrics)."""
        with self.lock:
            e = self._state(federation)["epochs"].get(epoch, {})
            owners = {k.partition("/")[0] for k in e.get("key_shares", {})}
            return "neighbours" in e and set(e["neighbours"]) <= owners

    def _key_for(self, e: dict[str, Any], *, federation: str, epoch: str, server_round: int) -> dict[str, Any]:
        """The mask key of `server_round`, made once (fresh pair, public half signed with the round, private half
        shared among this cluster's holders and sealed to each) and then always the same: a cluster has one key
        per round, so no two keys of one round can be shown to different holders. Its publication rides on an
        upload, or on a next-key reply."""
        if str(server_round) not in e["mask_keys"]:
            newest = max((int(r) for r, k in e["mask_keys"].items() if k["round"] is not None), default=0)
            if server_round <= newest:
                raise SecAggRefusal(f"round {server_round} is not after round {newest}, the last this cluster masked; "
                                    "no mask key is made for it")
            if sum(1 for r, k in e["mask_keys"].items() if k["round"] is None and int(r) > newest) >= FUTURE_KEYS:
                raise SecAggRefusal(f"this cluster holds {FUTURE_KEYS} unused mask keys of rounds ahead already; "
                                    f"no key is made for round {server_round}")
            pair = KeyPair.generate()
            pk = pair.public.decode()
            own, tokens = self._share_out(e, pair.private_pem, others=e["neighbours"], threshold=int(e["threshold"]),
                                          setup=e["setup"], header={"kind": "key", "epoch": epoch, "seq": server_round})
            e["mask_keys"][str(server_round)] = {
                "sk": pair.private_pem.decode(), "pk": pk, "round": None, "own_share": own, "tokens": tokens,
                "sig": self.identity.sign("mask-key", federation, epoch, e["setup_digest"], self.me, server_round, pk)}
        entry = e["mask_keys"][str(server_round)]
        return {"seq": server_round, "pk": entry["pk"], "sig": entry["sig"], "to": list(entry["tokens"]),
                "tokens": list(entry["tokens"].values())}

    def mask(self, plan: RoundPlan, *, values: np.ndarray, weight: int) -> np.ndarray:
        """The upload of this round: (w·x, w) encoded, masked with this cluster's mask key of the round and its
        neighbours', packed, with its self-mask seed shared out, the next mask key
        (rule 0 of reveal.py), its commitments and its signed receipt."""
        rng = np.random.default_rng(int.from_bytes(os.urandom(16), "little"))
        try:
            encoded = field.encode(values, weight=weight, code=plan.code, rng=rng)
        except FieldError as err:
            raise SecAggRefusal(f"cannot encode the update: {err}") from None
        with self.lock:
            e = self._set_up(plan.federation, plan.epoch)
            rounds = self._state(plan.federation)["rounds"]
            rid = _round_id(plan.epoch, plan.server_round)
            if rid in rounds:
                raise SecAggRefusal(f"round {plan.server_round} was masked already in epoch {plan.epoch}")
            seq, _ = plan.keys[self.me]
            own_key = self._own_key(e, plan.server_round)
            if own_key is None or (own_key["round"] is not None and self.rotate_keys):
                raise SecAggRefusal(f"the mask key of round {plan.server_round} masked it already")
            in_round = [n for n in e["neighbours"] if n in plan.round_set]
            seed = os.urandom(32)  # this round's self mask: fresh, never reused
            pair: dict[int, list[bytes]] = {1: [], -1: []}
            pair_commits: dict[str, str] = {}
            for other in in_round:
                key = self._pair_key(own_key["sk"], other, plan.keys[other], mine=seq, epoch=plan.epoch,
                                     server_round=plan.server_round)
                pair[pair_sign(self.me, other)].append(key)
                pair_commits[other] = commitment(key)
            own, tokens = self._share_out(e, seed, others=in_round, threshold=plan.threshold, setup=e["setup"],
                                          header={"kind": "self", "epoch": plan.epoch, "round": plan.server_round,
                                                  "key": seq})
            masked = field.pack(mask_input(encoded, code=plan.code, self_seed=seed, pair_keys=pair), bits=plan.code.bits)
            own_key["round"] = plan.server_round
            _prune_keys(e)
            used = {m: k for m, (k, _) in plan.keys.items()}
            head: dict[str, Any] = {"tokens": tokens, "commit": {"self": commitment(seed), "pairs": pair_commits},
                                    "keys": used}
            if self.rotate_keys:  # the next round's key rides on this upload: no trip of its own
                head["next-key"] = self._key_for(e, federation=plan.federation, epoch=plan.epoch,
                                                 server_round=plan.server_round + 1)
            head["receipt"] = self.identity.sign("upload", *evidence.upload_fields(
                federation=plan.federation, epoch=plan.epoch, setup=e["setup_digest"], server_round=plan.server_round,
                round_set=plan.round_set, member=self.me, keys=used, digest=digest(head, masked)))
            rounds[rid] = {"epoch": plan.epoch, "round": plan.server_round, "round_set": list(plan.round_set),
                           "own_share": own, "keys": used, "pks": {m: pk for m, (_, pk) in plan.keys.items()},
                           "created": max((r.get("created", 0) for r in rounds.values()), default=0) + 1}
            self._save(plan.federation)
        return pack_upload(masked=masked, head=head)

    def _pair_key(self, own_sk: str, other: str, theirs: tuple[int, str] | list[Any], *, mine: int, epoch: str,
                  server_round: int) -> bytes:
        """The round key of this cluster's mask with `other` in `server_round` (both mask keys of the round)."""
        secret = shares.pair_secret(own_sk.encode(), str(theirs[1]).encode())
        return round_key(secret, epoch=epoch, server_round=server_round,
                         seqs=pair_order(self.me, other, mine, int(theirs[0])))

    def _next_key(self, federation: str, epoch: str, request: dict[str, Any]) -> dict[str, Any]:
        """This cluster's mask key of `round`, for a server that lacks it (the upload that carried it never came,
        or this cluster was not in the round before): made now if it does not exist, else the same again."""
        e = self._set_up(federation, epoch)
        rnd = _round_number(request.get("round"))
        out = self._key_for(e, federation=federation, epoch=epoch, server_round=rnd)
        self._save(federation)
        return out

    # -- agreeing on a view, and unmasking -------------------------------------------------------------
    def _round(self, federation: str, epoch: str, rnd: int) -> dict[str, Any]:
        entry = self._state(federation)["rounds"].get(_round_id(epoch, rnd))
        if entry is None:
            raise SecAggRefusal(f"cluster {self.me} did not upload round {rnd} in epoch {epoch}")
        return entry

    def _checked_view(self, e: dict[str, Any], entry: dict[str, Any], log: RevealLog, request: dict[str, Any],
                      rnd: int) -> tuple[set[str], set[str]]:
        """(survivors, dropped) of the request, if rules 1 and 2 of reveal.py allow acting on them."""
        survivors = _members(request.get("survivors"), "survivors")
        dropped = _members(request.get("dropped", []), "dropouts")
        why = refuse_view(log, me=self.me, server_round=rnd, round_set=set(entry["round_set"]), survivors=survivors,
                          dropped=dropped, threshold=int(e["threshold"]))
        if why:
            raise SecAggRefusal(why)
        return survivors, dropped

    def _view(self, federation: str, epoch: str, request: dict[str, Any]) -> dict[str, Any]:
        """Sign the survivor set of a round with dropouts; signing commits this cluster to it (rule 2)."""
        e = self._set_up(federation, epoch)
        rnd = _round_number(request.get("round"))
        entry = self._round(federation, epoch, rnd)
        log = RevealLog.from_state_dict(e["log"])
        survivors, dropped = self._checked_view(e, entry, log, request, rnd)
        if not dropped:
            raise SecAggRefusal(f"round {rnd} has no dropouts: it is unmasked on the upload receipts, unsigned")
        log.views[rnd] = [sorted(survivors), sorted(dropped)]
        e["log"] = log.state_dict()
        self._save(federation)
        sig = self.identity.sign("view", *evidence.view_fields(
            federation=federation, epoch=epoch, setup=e["setup_digest"], server_round=rnd, round_set=entry["round_set"],
            survivors=survivors))
        return {"signature": sig}

    def _unmask(self, federation: str, epoch: str, request: dict[str, Any]) -> dict[str, Any]:
        e = self._set_up(federation, epoch)
        rnd = _round_number(request.get("round"))
        entry = self._round(federation, epoch, rnd)
        digest_ = hashlib.sha256(json.dumps(request, sort_keys=True, default=str).encode()).hexdigest()
        if "unmask" in entry:  # asked again (a lost reply): the same answer; asked otherwise: refused
            if entry["unmask"]["digest"] != digest_:
                raise SecAggRefusal(f"round {rnd} was unmasked already; a different request for it is refused")
            return entry["unmask"]["reply"]
        log = RevealLog.from_state_dict(e["log"])
        survivors, dropped = self._checked_view(e, entry, log, request, rnd)
        self._check_evidence(e, entry, request, federation=federation, epoch=epoch, rnd=rnd,
                             survivors=survivors, dropped=dropped)
        survivor_keys = {c: key_id(c, entry["keys"][c]) for c in survivors if c in entry["keys"]}
        why = refuse_unmask(log, server_round=rnd, survivor_keys=survivor_keys)
        if why:
            raise SecAggRefusal(why)
        senders, tokens = request.get("from") or [], request.get("tokens") or []
        if not isinstance(senders, list) or not isinstance(tokens, list) or len(senders) != len(tokens):
            raise SecAggRefusal("the forwarded self-mask shares and their senders do not line up")
        sealed = dict(zip(map(str, senders), tokens))
        out_from, out_shares, unreadable = [self.me], [entry["own_share"]], []
        for sender in sorted(survivors & set(e["neighbours"])):
            if sender not in sealed:
                unreadable.append(sender)
                continue
            header = {"kind": "self", "from": sender, "to": self.me, "epoch": epoch, "round": rnd,
                      "key": entry["keys"][sender]}
            try:
                piece = shares.unseal(self._seal_key(e, sender, e["setup"]), str(sealed[sender]).encode(),
                                      expect=header)
            except ShareError:
                unreadable.append(sender)
                continue
            out_from.append(sender)
            out_shares.append(b64(piece))
        pair_with = sorted(dropped & set(e["neighbours"]))
        own_key = self._own_key(e, rnd)
        if own_key is None:
            raise SecAggRefusal(f"the mask key of round {rnd} is no longer kept; its pair keys cannot be given")
        own_sk = own_key["sk"]
        pair_keys = [b64(self._pair_key(own_sk, other, (entry["keys"][other], entry["pks"][other]),
                                        mine=entry["keys"][self.me], epoch=epoch, server_round=rnd))
                     for other in pair_with]
        log.views[rnd] = [sorted(survivors), sorted(dropped)]
        log.certified.add(rnd)
        log.self_shares.setdefault(rnd, set()).update(out_from)
        log.self_keys.update(key_id(c, entry["keys"][c]) for c in out_from)
        log.pair_keys.setdefault(rnd, set()).update(pair_with)
        e["log"] = log.state_dict()
        reply = {"self-from": out_from, "self-shares": out_shares, "pair-with": pair_with, "pair-keys": pair_keys,
                 "unreadable": unreadable}
        entry["unmask"] = {"digest": digest_, "reply": reply}
        self._save(federation)
        return reply

    def _check_evidence(self, e: dict[str, Any], entry: dict[str, Any], request: dict[str, Any], *, federation: str,
                        epoch: str, rnd: int, survivors: set[str], dropped: set[str]) -> None:
        """Rule 3 of reveal.py: every member's receipt (no dropouts), or a view certified around this cluster
        and its surviving neighbours' receipts; every surviving neighbour masked with the keys this cluster did."""
        round_set, ids = entry["round_set"], e["ids"]
        needed = round_set if not dropped else sorted(survivors & set(entry["keys"]))
        receipts = evidence.valid_receipts(evidence.json_map(request.get("receipts")), ids=ids, federation=federation,
                                           epoch=epoch, setup=e["setup_digest"], server_round=rnd,
                                           round_set=round_set, members=needed)
        missing = sorted(set(needed) - set(receipts))
        if missing:
            raise SecAggRefusal(f"no valid upload receipt of cluster(s) {missing} for round {rnd}: the server "
                                + ("claims nobody dropped without the proof" if not dropped else
                                   "claims they survived without the proof"))
        if why := refuse_keys(entry["keys"], me=self.me, receipts=receipts, survivors=survivors):
            raise SecAggRefusal(f"round {rnd}: {why}")
        if not dropped:
            return
        signers = evidence.view_signers(evidence.json_map(request.get("signatures")), ids=ids, federation=federation,
                                        epoch=epoch, setup=e["setup_digest"], server_round=rnd, round_set=round_set,
                                        survivors=sorted(survivors))
        why = evidence.uncertified(signers, me=self.me, dropped=dropped, neighbours=e["graph"],
                                   threshold=int(e["threshold"]))
        if why:
            raise SecAggRefusal(f"round {rnd}'s survivor set is not certified: {why}")

    def _recover(self, federation: str, epoch: str, request: dict[str, Any]) -> dict[str, Any]:
        """Shares of the mask keys that dropped clusters were to mask `round` with, as this cluster masked it."""
        e = self._set_up(federation, epoch)
        rnd = _round_number(request.get("round"))
        wanted = _members(request.get("clusters"), "clusters")
        entry = self._round(federation, epoch, rnd)
        named = {c: key_id(c, entry["keys"][c]) for c in wanted if c in entry["keys"]}
        if set(named) != wanted:
            raise SecAggRefusal(f"cluster(s) {sorted(wanted - set(named))} were not this cluster's neighbours in "
                                f"round {rnd}")
        log = RevealLog.from_state_dict(e["log"])
        why = refuse_recover(log, server_round=rnd, wanted=named)
        if why:
            raise SecAggRefusal(why)
        held = {c: e["key_shares"][k] for c, k in sorted(named.items()) if k in e["key_shares"]}
        log.key_shares.update(named[c] for c in held)
        e["log"] = log.state_dict()
        self._save(federation)
        return {"key-from": list(held), "key-shares": list(held.values()),
                "key-ids": [named[c] for c in held]}


def _prune_keys(e: dict[str, Any]) -> None:
    """Drop own mask keys that can serve nothing: used ones beyond the newest KEPT_KEYS, unused ones of rounds before
    the newest round masked (that round is past; no key is made for it again)."""
    used = sorted((int(r) for r, k in e["mask_keys"].items() if k["round"] is not None), reverse=True)
    for r in used[KEPT_KEYS:]:
        del e["mask_keys"][str(r)]
    for r, k in list(e["mask_keys"].items()):
        if k["round"] is None and used and int(r) < used[0]:
            del e["mask_keys"][r]


def _round_id(epoch: str, server_round: int) -> str:
    """A round's record, by epoch and round: another epoch's round of the same number is another round."""
    return f"{epoch}/{int(server_round)}"
