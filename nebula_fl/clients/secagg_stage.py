"""The cluster's side of secure aggregation: its keys, the shares it holds, masking, and what it reveals.

Lives on rank 0 beside the privacy gate, so only masked vectors leave the cluster. Four requests come
from the server (through the ClientApp): `keys` (a new epoch: two fresh EC key pairs, public halves
out), `share` (the epoch's members and their public keys: the neighbour graph is computed here, the
mask key is Shamir-shared among the neighbours and itself, each share sealed to its holder), then per
round the masking of the update (the train request carries the epoch, the round's clusters and, once,
the key shares sealed to this cluster), `unmask` (self-mask shares of survivors, pair keys with
clusters that dropped) and, rarely, `recover` (key shares of a dropped cluster). `reveal.py` decides
what may be revealed. The state (private keys included) is a 0600 JSON file in the state folder,
written before any reply leaves, so a restarted trainer keeps its keys and its promises.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from nebula_fl.errors import NebulaError
from nebula_fl.secagg import field, graph, shares
from nebula_fl.secagg.field import FieldCode, FieldError
from nebula_fl.secagg.masking import mask_input
from nebula_fl.secagg.masks import pair_sign, round_key
from nebula_fl.secagg.reveal import RevealLog, refuse_recover, refuse_unmask
from nebula_fl.secagg.shares import KeyPair, ShareError
from nebula_fl.secagg.wire import pack_upload

KEPT_EPOCHS = 2
KEPT_ROUNDS = 8


class SecAggRefusal(NebulaError):
    """A secure-aggregation request this cluster refuses (the reason goes back to the server and the log)."""


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text.encode(), validate=True)


@dataclass(frozen=True, kw_only=True)
class RoundPlan:
    """What the train request of a secure round fixed, checked before training."""

    federation: str
    epoch: str
    server_round: int
    round_set: tuple[str, ...]
    code: FieldCode
    threshold: int


class SecAggStage:
    def __init__(self, *, state_dir: Path, cluster_id: int) -> None:
        self.me = str(cluster_id)
        self.folder = state_dir / "secagg"
        self.lock = threading.Lock()
        self.states: dict[str, dict[str, Any]] = {}  # federation -> its state

    # -- state -------------------------------------------------------------------------------------
    def _path(self, federation: str) -> Path:
        return self.folder / f"{federation}.json"

    def _state(self, federation: str) -> dict[str, Any]:
        if federation not in self.states:
            path = self._path(federation)
            self.states[federation] = json.loads(path.read_text()) if path.exists() else {"epochs": {}, "rounds": {}}
        return self.states[federation]

    def _save(self, federation: str) -> None:
        """Written and fsynced before the reply leaves: what was revealed is never forgotten."""
        state = self._state(federation)
        epochs = sorted(state["epochs"], key=lambda e: state["epochs"][e]["created"])
        for old in epochs[:-KEPT_EPOCHS]:
            del state["epochs"][old]
        for old in sorted(state["rounds"], key=int)[:-KEPT_ROUNDS]:
            del state["rounds"][old]
        self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = self._path(federation).with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            json.dump(state, handle)
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

    # -- requests from the server ------------------------------------------------------------------
    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        """One setup or unmasking request; returns the reply (raises SecAggRefusal with the reason)."""
        stage, federation, epoch = request.get("stage"), request.get("federation-id"), request.get("epoch")
        if not isinstance(federation, str) or not isinstance(epoch, str) or not epoch:
            raise SecAggRefusal("a secure-aggregation request without its federation id and epoch")
        with self.lock:
            if stage == "keys":
                return self._keys(federation, epoch)
            if stage == "share":
                return self._share(federation, epoch, request)
            if stage == "unmask":
                return self._unmask(federation, epoch, request)
            if stage == "recover":
                return self._recover(federation, epoch, request)
        raise SecAggRefusal(f"unknown secure-aggregation stage {stage!r}")

    def _keys(self, federation: str, epoch: str) -> dict[str, Any]:
        epochs = self._state(federation)["epochs"]
        if epoch not in epochs:  # a replayed request gets the same keys, never a second pair for one epoch
            c, s = KeyPair.generate(), KeyPair.generate()
            epochs[epoch] = {"created": max((e["created"] for e in epochs.values()), default=-1) + 1,
                             "c_sk": c.private_pem.decode(), "c_pk": c.public.decode(),
                             "s_sk": s.private_pem.decode(), "s_pk": s.public.decode()}
            self._save(federation)
        e = epochs[epoch]
        return {"c-pk": e["c_pk"], "s-pk": e["s_pk"]}

    def _share(self, federation: str, epoch: str, request: dict[str, Any]) -> dict[str, Any]:
        e = self._epoch(federation, epoch)
        members, c_pks, s_pks = request.get("members"), request.get("c-pks"), request.get("s-pks")
        if not (isinstance(members, list) and isinstance(c_pks, list) and isinstance(s_pks, list)
                and len(members) == len(c_pks) == len(s_pks) and all(isinstance(m, str) for m in members)):
            raise SecAggRefusal("the share request's members and public keys do not line up")
        setup = {"members": members, "c_pks": c_pks, "s_pks": s_pks,
                 "num_shares": request.get("num-shares"), "threshold": request.get("threshold")}
        if "setup" in e:  # a replay: the same answer, or a refusal if the server changed anything
            if e["setup"] != setup:
                raise SecAggRefusal(f"epoch {epoch} was set up already with other members or keys")
            return {"to": list(e["tokens"]), "tokens": list(e["tokens"].values())}
        if self.me not in members:
            raise SecAggRefusal(f"cluster {self.me} is not among the epoch's members {members}")
        mine = members.index(self.me)
        if (c_pks[mine], s_pks[mine]) != (e["c_pk"], e["s_pk"]):
            raise SecAggRefusal("the server lists other public keys for this cluster than the ones it gave")
        if len(set(c_pks)) != len(c_pks) or len(set(s_pks)) != len(s_pks):
            raise SecAggRefusal("two members of the epoch share a public key")
        num_shares, threshold = setup["num_shares"], setup["threshold"]
        if isinstance(num_shares, bool) or not isinstance(num_shares, int) or num_shares < 0:
            raise SecAggRefusal(f"num-shares {num_shares!r} is not a count")
        nbrs = graph.neighbours(members, num_shares=num_shares, seed=epoch)[self.me]
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
        pieces = shares.split(e["s_sk"].encode(), threshold=threshold, holders=holders)
        tokens: dict[str, str] = {}
        for holder, piece in zip((self.me, *nbrs), pieces):
            if holder == self.me:
                e["own_key_share"] = b64(piece)
                continue
            key = shares.fernet_key(e["c_sk"].encode(), c_pks[members.index(holder)].encode())
            header = {"kind": "key", "from": self.me, "to": holder, "epoch": epoch}
            tokens[holder] = shares.seal(key, header=header, share=piece).decode()
        e.update(setup=setup, neighbours=list(nbrs), threshold=threshold, tokens=tokens, key_shares={},
                 log=RevealLog().state_dict())
        self._save(federation)
        return {"to": list(tokens), "tokens": list(tokens.values())}

    # -- a secure round ----------------------------------------------------------------------------
    def prepare(self, config: dict[str, Any]) -> RoundPlan:
        """Check a secure round's train request and keep the key shares it delivers; before any training."""
        federation, epoch, rnd = config.get("federation-id"), config.get("secagg-epoch"), config.get("server-round")
        with self.lock:
            e = self._epoch(str(federation), str(epoch))
            if "setup" not in e:
                raise SecAggRefusal(f"epoch {epoch} has no shares yet; the server must finish its setup")
            round_set = config.get("secagg-round-set")
            if not isinstance(round_set, list) or self.me not in round_set or len(set(round_set)) != len(round_set):
                raise SecAggRefusal(f"the round's clusters {round_set!r} do not include cluster {self.me} once")
            unknown = set(round_set) - set(e["setup"]["members"])
            if unknown:
                raise SecAggRefusal(f"the round names cluster(s) {sorted(unknown)} outside epoch {epoch}")
            holders = ({self.me, *e["neighbours"]}) & set(round_set)
            if len(holders) < e["threshold"]:
                raise SecAggRefusal(f"only {len(holders)} of this cluster's share holders are in the round; "
                                    f"{e['threshold']} are needed to unmask it")
            try:
                code = FieldCode(bits=int(config["secagg-bits"]), clip=float(config["secagg-clip"]),
                                 max_weight=int(config["secagg-max-weight"]), clusters=len(round_set))
            except (KeyError, TypeError, ValueError) as err:
                raise SecAggRefusal(f"the round's field encoding is invalid: {err}") from None
            self._deliver(e, epoch=str(epoch), config=config)
            self._save(str(federation))
            return RoundPlan(federation=str(federation), epoch=str(epoch), server_round=int(rnd),
                             round_set=tuple(round_set), code=code, threshold=int(e["threshold"]))

    def _deliver(self, e: dict[str, Any], *, epoch: str, config: dict[str, Any]) -> None:
        senders, tokens = config.get("secagg-key-from") or [], config.get("secagg-key-tokens") or []
        if len(senders) != len(tokens):
            raise SecAggRefusal("the delivered key shares and their senders do not line up")
        members = e["setup"]["members"]
        for sender, token in zip(senders, tokens):
            if sender not in e["neighbours"] or sender in e["key_shares"]:
                continue
            key = shares.fernet_key(e["c_sk"].encode(), e["setup"]["c_pks"][members.index(sender)].encode())
            try:
                piece = shares.unseal(key, str(token).encode(),
                                      expect={"kind": "key", "from": sender, "to": self.me, "epoch": epoch})
            except ShareError as err:
                raise SecAggRefusal(f"the key share of cluster {sender} does not open: {err}") from None
            e["key_shares"][sender] = b64(piece)

    def holds_keys(self, federation: str, epoch: str) -> bool:
        """Whether this cluster holds a key share from every neighbour (the server stops sending them)."""
        with self.lock:
            e = self._state(federation)["epochs"].get(epoch, {})
            return "neighbours" in e and set(e["neighbours"]) <= set(e.get("key_shares", {}))

    def mask(self, plan: RoundPlan, *, values: np.ndarray, weight: int) -> np.ndarray:
        """The upload of this round: (w·x, w) encoded, masked, packed, with its self-mask seed shared out."""
        rng = np.random.default_rng(int.from_bytes(os.urandom(16), "little"))
        try:
            encoded = field.encode(values, weight=weight, code=plan.code, rng=rng)
        except FieldError as err:
            raise SecAggRefusal(f"cannot encode the update: {err}") from None
        with self.lock:
            e = self._epoch(plan.federation, plan.epoch)
            members = e["setup"]["members"]
            in_round = [n for n in e["neighbours"] if n in plan.round_set]
            seed = os.urandom(32)  # this round's self mask: fresh, never reused
            pair: dict[int, list[bytes]] = {1: [], -1: []}
            for other in in_round:
                secret = shares.pair_secret(e["s_sk"].encode(), e["setup"]["s_pks"][members.index(other)].encode())
                pair[pair_sign(self.me, other)].append(
                    round_key(secret, epoch=plan.epoch, server_round=plan.server_round))
            holders = [self.me, *in_round]
            pieces = shares.split(seed, threshold=plan.threshold, holders=len(holders))
            tokens: dict[str, str] = {}
            for holder, piece in zip(holders, pieces):
                if holder == self.me:
                    own = b64(piece)
                    continue
                key = shares.fernet_key(e["c_sk"].encode(), e["setup"]["c_pks"][members.index(holder)].encode())
                header = {"kind": "self", "from": self.me, "to": holder, "epoch": plan.epoch,
                          "round": plan.server_round}
                tokens[holder] = shares.seal(key, header=header, share=piece).decode()
            masked = mask_input(encoded, code=plan.code, self_seed=seed, pair_keys=pair)
            self._state(plan.federation)["rounds"][str(plan.server_round)] = {
                "epoch": plan.epoch, "round_set": list(plan.round_set), "own_share": own}
            self._save(plan.federation)
        return pack_upload(masked=field.pack(masked, bits=plan.code.bits), tokens=tokens)

    # -- unmasking -----------------------------------------------------------------------------------
    def _round(self, federation: str, epoch: str, rnd: Any) -> dict[str, Any]:
        entry = self._state(federation)["rounds"].get(str(rnd))
        if entry is None or entry["epoch"] != epoch:
            raise SecAggRefusal(f"cluster {self.me} did not upload round {rnd} in epoch {epoch}")
        return entry

    def _unmask(self, federation: str, epoch: str, request: dict[str, Any]) -> dict[str, Any]:
        e = self._epoch(federation, epoch)
        rnd = request.get("round")
        entry = self._round(federation, epoch, rnd)
        survivors, dropped = set(request.get("survivors") or []), set(request.get("dropped") or [])
        digest = hashlib.sha256(json.dumps([sorted(survivors), sorted(dropped), request.get("from"),
                                            request.get("tokens")], sort_keys=True).encode()).hexdigest()
        if "unmask" in entry:  # asked again (a lost reply): the same answer; asked otherwise: refused
            if entry["unmask"]["digest"] != digest:
                raise SecAggRefusal(f"round {rnd} was unmasked already; a different request for it is refused")
            return entry["unmask"]["reply"]
        if self.me not in survivors or not (survivors | dropped) <= set(entry["round_set"]):
            raise SecAggRefusal(f"the unmask request's clusters do not match round {rnd}'s")
        if (survivors | dropped) != set(entry["round_set"]):
            raise SecAggRefusal(f"the unmask request leaves out some of round {rnd}'s clusters")
        log = RevealLog.from_state_dict(e["log"])
        why = refuse_unmask(log, server_round=int(rnd), survivors=survivors, dropped=dropped)
        if why:
            raise SecAggRefusal(why)
        members = e["setup"]["members"]
        senders, tokens = request.get("from") or [], request.get("tokens") or []
        if len(senders) != len(tokens):
            raise SecAggRefusal("the forwarded self-mask shares and their senders do not line up")
        sealed = dict(zip(senders, tokens))
        out_from, out_shares, unreadable = [self.me], [entry["own_share"]], []
        for sender in sorted(survivors & set(e["neighbours"])):
            if sender not in sealed:
                unreadable.append(sender)
                continue
            key = shares.fernet_key(e["c_sk"].encode(), e["setup"]["c_pks"][members.index(sender)].encode())
            header = {"kind": "self", "from": sender, "to": self.me, "epoch": epoch, "round": int(rnd)}
            try:
                piece = shares.unseal(key, str(sealed[sender]).encode(), expect=header)
            except ShareError:
                unreadable.append(sender)
                continue
            out_from.append(sender)
            out_shares.append(b64(piece))
        pair_with, pair_keys = [], []
        for other in sorted(dropped & set(e["neighbours"])):
            secret = shares.pair_secret(e["s_sk"].encode(), e["setup"]["s_pks"][members.index(other)].encode())
            pair_with.append(other)
            pair_keys.append(b64(round_key(secret, epoch=epoch, server_round=int(rnd))))
        log.self_shares.setdefault(int(rnd), set()).update(out_from)
        log.pair_keys.setdefault(int(rnd), set()).update(pair_with)
        log.dropped[int(rnd)] = dropped
        e["log"] = log.state_dict()
        reply = {"self-from": out_from, "self-shares": out_shares, "pair-with": pair_with, "pair-keys": pair_keys,
                 "unreadable": unreadable}
        entry["unmask"] = {"digest": digest, "reply": reply}
        self._save(federation)
        return reply

    def _recover(self, federation: str, epoch: str, request: dict[str, Any]) -> dict[str, Any]:
        e = self._epoch(federation, epoch)
        rnd = request.get("round")
        wanted = set(request.get("clusters") or [])
        log = RevealLog.from_state_dict(e["log"])
        if isinstance(rnd, bool) or not isinstance(rnd, int):
            raise SecAggRefusal(f"round {rnd!r} is not a round number")
        why = refuse_recover(log, server_round=rnd, clusters=wanted)
        if why:
            raise SecAggRefusal(why)
        held = {c: e["key_shares"][c] for c in sorted(wanted) if c in e.get("key_shares", {})}
        log.key_shares.update(held)
        e["log"] = log.state_dict()
        self._save(federation)
        return {"key-from": list(held), "key-shares": list(held.values())}
