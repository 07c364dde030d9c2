"""The server's reading of the clusters' secure-aggregation replies: anything malformed is a ReplyError.

A reply comes from a cluster that may be faulty or lying, through a network that may tamper with it. Its
holder is dropped from the stage with the error's reason; nothing in a reply can raise anything else out
of the round, and nothing a reply names outside what its holder may reveal is taken.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from nebula_fl.secagg.identity import check_public
from nebula_fl.secagg.masks import KEY_BYTES
from nebula_fl.secagg.rebuild import rebuild
from nebula_fl.secagg.shares import ShareError, matches_public
from nebula_fl.secagg.wire import commitment

MAX_SHARE_BYTES = 4 + 16 * 64  # a Shamir share of at most 1 KB of secret (a P-384 PEM is ~300 bytes)


class ReplyError(ValueError):
    """A reply the server cannot use; the message says what is wrong with it."""


@dataclass(frozen=True)
class Unmasked:
    """What one holder revealed for a round."""

    self_shares: dict[str, bytes]  # survivor -> this holder's share of its self-mask seed
    pair_keys: dict[str, bytes]  # dropped neighbour -> the round key of this holder's mask with it
    unreadable: tuple[str, ...]  # survivors whose sealed share this holder could not open


def _names(reply: Mapping[str, Any], key: str) -> list[str]:
    value = reply.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value) or len(set(value)) != len(value):
        raise ReplyError(f"'{key}' is not a list of distinct cluster ids")
    return value


def _bytes(value: Any, *, what: str, size: int | None = None, most: int = MAX_SHARE_BYTES) -> bytes:
    if not isinstance(value, str) or len(value) > 2 * most:
        raise ReplyError(f"{what} is not a base64 string of at most {most} bytes")
    try:
        raw = base64.b64decode(value.encode(), validate=True)
    except (binascii.Error, UnicodeEncodeError):
        raise ReplyError(f"{what} is not base64") from None
    if (size is not None and len(raw) != size) or len(raw) > most:
        raise ReplyError(f"{what} is {len(raw)} bytes, not {size if size is not None else f'at most {most}'}")
    return raw


def _paired(reply: Mapping[str, Any], names: str, values: str) -> list[tuple[str, Any]]:
    keys, vals = _names(reply, names), reply.get(values, [])
    if not isinstance(vals, list) or len(vals) != len(keys):
        raise ReplyError(f"'{names}' and '{values}' do not line up")
    return list(zip(keys, vals))


def parse_unmask(reply: Mapping[str, Any], *, holder: str, survivors: set[str], dropped: set[str],
                 neighbours: set[str]) -> Unmasked:
    """One holder's unmask reply, checked against what it may reveal: shares of its holders that survived,
    pair keys with its neighbours that dropped."""
    own = ({holder} | neighbours) & survivors
    self_shares = {}
    for cid, value in _paired(reply, "self-from", "self-shares"):
        if cid not in own:
            raise ReplyError(f"it returns a self-mask share of cluster {cid}, which it does not hold for this round")
        self_shares[cid] = _bytes(value, what=f"the self-mask share of cluster {cid}")
    pair_keys = {}
    for cid, value in _paired(reply, "pair-with", "pair-keys"):
        if cid not in neighbours & dropped:
            raise ReplyError(f"it returns a pair key with cluster {cid}, which is not a neighbour that dropped")
        pair_keys[cid] = _bytes(value, what=f"the pair key with cluster {cid}", size=KEY_BYTES)
    return Unmasked(self_shares=self_shares, pair_keys=pair_keys, unreadable=tuple(_names(reply, "unreadable")))


def parse_recover(reply: Mapping[str, Any], *, wanted: set[str]) -> dict[str, bytes]:
    """One holder's key shares of dropped clusters (only of those asked)."""
    out = {}
    for cid, value in _paired(reply, "key-from", "key-shares"):
        if cid not in wanted:
            raise ReplyError(f"it returns a key share of cluster {cid}, which was not asked for")
        out[cid] = _bytes(value, what=f"the key share of cluster {cid}")
    return out


def parse_keys(reply: Mapping[str, Any]) -> tuple[str, str, str, str]:
    """(c public key, s public key, identity key, signature of the two) of a key-setup reply; shapes only (the
    EC keys are checked by every cluster, the signature against the identity by the server and every cluster)."""
    c_pk, s_pk, id_pk, sig = (reply.get(k) for k in ("c-pk", "s-pk", "id-pk", "key-sig"))
    if not all(isinstance(v, str) and 0 < len(v) <= 4096 for v in (c_pk, s_pk, id_pk, sig)):
        raise ReplyError("a key-setup reply needs 'c-pk', 's-pk', 'id-pk' and 'key-sig' strings")
    try:
        check_public(id_pk)
    except (ValueError, TypeError) as err:
        raise ReplyError(f"its identity key is not an Ed25519 key ({err})") from None
    return c_pk, s_pk, id_pk, sig  # type: ignore[return-value]


def parse_key_publication(value: Any, *, server_round: int) -> tuple[str, str]:
    """(public key, signature) of a cluster's mask key of `server_round`, from its upload (the next round's key)
    or a next-key reply: bound to exactly that round, strings of sane size; the signature is checked by the
    caller, the key's curve by every cluster that masks with it."""
    if not isinstance(value, Mapping):
        raise ReplyError("it carries no mask key for the next round")
    seq, pk, sig = value.get("seq"), value.get("pk"), value.get("sig")
    if isinstance(seq, bool) or seq != server_round:
        raise ReplyError(f"its mask key is for round {seq!r}, not {server_round}")
    if not (isinstance(pk, str) and 0 < len(pk) <= 4096 and isinstance(sig, str) and 0 < len(sig) <= 256):
        raise ReplyError("its mask key needs 'pk' and 'sig' strings")
    return pk, sig


def parse_signature(reply: Mapping[str, Any]) -> str:
    sig = reply.get("signature")
    if not isinstance(sig, str) or len(sig) > 256:
        raise ReplyError("a view reply needs a 'signature' string")
    return sig


def parse_share_tokens(reply: Mapping[str, Any]) -> dict[str, str]:
    """Holder -> sealed key share, from a share-distribution reply."""
    out = {}
    for cid, token in _paired(reply, "to", "tokens"):
        if not isinstance(token, str):
            raise ReplyError(f"the sealed key share for cluster {cid} is not a string")
        out[cid] = token
    return out



@dataclass
class Unmasking:
    """What the unmask replies of a round give the server, every piece checked."""

    seeds: dict[str, bytes] = field(default_factory=dict)  # survivor -> its self-mask seed (matches its commitment)
    pair_keys: dict[tuple[str, str], bytes] = field(default_factory=dict)  # (survivor, dropped) -> their round key
    bad: dict[str, str] = field(default_factory=dict)  # holder -> why (part of) its reply was not used
    unreadable: dict[str, list[str]] = field(default_factory=dict)  # holder -> survivors whose share it could not open


def read_unmask(replies: Mapping[str, Any], *, survivors: list[str], dropped: list[str],
                neighbours: Mapping[str, Any], threshold: int, commits: Mapping[str, Mapping[str, Any]]) -> Unmasking:
    """The server's reading of a round's unmask replies (holder -> reply): a malformed reply drops its holder, a
    share or key that does not match its uploader's commitment is left out and names its holder. ShareError if a
    survivor's seed cannot be rebuilt from the shares that are left."""
    out = Unmasking()
    revealed: dict[str, Unmasked] = {}
    for holder, reply in replies.items():
        try:
            if not isinstance(reply, Mapping):
                raise ReplyError("it is not a record")
            revealed[holder] = parse_unmask(reply, holder=holder, survivors=set(survivors), dropped=set(dropped),
                                            neighbours=set(neighbours[holder]))
        except ReplyError as err:
            out.bad[holder] = str(err)
            continue
        if revealed[holder].unreadable:
            out.unreadable[holder] = list(revealed[holder].unreadable)
    for cluster in survivors:
        pieces = {h: r.self_shares[cluster] for h, r in revealed.items() if cluster in r.self_shares}
        commit = commits[cluster]["self"]
        try:
            out.seeds[cluster], wrong = rebuild(pieces, threshold=threshold, check=lambda s, c=commit: commitment(s) == c)
        except ShareError as err:
            raise ShareError(f"the self-mask seed of cluster {cluster}: {err}") from None
        for holder in wrong:
            out.bad[holder] = f"its share of cluster {cluster}'s self-mask seed is wrong"
    for gone in dropped:
        for j in survivors:
            key = revealed[j].pair_keys.get(gone) if j in revealed else None
            if key is None:
                continue
            if commitment(key) == commits[j]["pairs"].get(gone):
                out.pair_keys[(j, gone)] = key
            else:
                out.bad[j] = f"its pair key with cluster {gone} does not match its commitment"
    return out


def read_recover(replies: Mapping[str, Any], *, asked: Mapping[str, set[str]], threshold: int,
                 public_keys: Mapping[str, bytes]) -> tuple[dict[str, bytes], dict[str, str]]:
    """(dropped cluster -> its rebuilt mask key, holder -> why its reply was not used) from the recover replies;
    each key must match the public key it stands for. ShareError if one cannot be rebuilt."""
    held: dict[str, dict[str, bytes]] = {}
    bad: dict[str, str] = {}
    for holder, reply in replies.items():
        try:
            if not isinstance(reply, Mapping):
                raise ReplyError("it is not a record")
            held[holder] = parse_recover(reply, wanted=set(asked.get(holder, ())))
        except ReplyError as err:
            bad[holder] = str(err)
    keys = {}
    for gone, public in public_keys.items():
        pieces = {h: r[gone] for h, r in held.items() if gone in r}
        try:
            keys[gone], wrong = rebuild(pieces, threshold=threshold, check=lambda k, p=public: matches_public(k, p))
        except ShareError as err:
            raise ShareError(f"the mask key of dropped cluster {gone}: {err}") from None
        bad.update({h: f"its key share of cluster {gone} is wrong" for h in wrong})
    return keys, bad
