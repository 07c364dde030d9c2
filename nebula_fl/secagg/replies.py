"""The server's reading of the clusters' secure-aggregation replies: anything malformed is a ReplyError.

A reply comes from a cluster that may be faulty or lying, through a network that may tamper with it. Its
holder is dropped from the stage with the error's reason; nothing in a reply can raise anything else out
of the round, and nothing a reply names outside what its holder may reveal is taken.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nebula_fl.secagg.identity import check_public
from nebula_fl.secagg.masks import KEY_BYTES

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

