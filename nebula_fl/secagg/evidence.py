"""The evidence a holder needs before it reveals anything: upload receipts, or a certified survivor set.

Both ride on messages that are sent anyway, so a round without dropouts costs no extra trip:
- an *upload receipt* is a cluster's signature of (federation, epoch, round, round set, the numbers of the
  mask keys it masked with — its own and each neighbour's in the round —, digest of its upload), made when
  it masks and carried inside the upload. A round in which every member of the round set uploaded is
  unmasked on the receipts of all of them (the "full view"); every unmask request carries the survivors'
  receipts, so a holder checks that each surviving neighbour masked with the very keys it did.
- a *view signature* is a survivor's signature of (federation, epoch, round, round set, survivors), made
  in the one extra trip of a round with dropouts, once per round (see reveal.py: signing commits).

Pure functions of the identity keys and the neighbour graph; `reveal.py` says why each check is enough.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from nebula_fl.secagg.identity import verify


def setup_record(*, members: list[str], c_pks: list[str], s_pks: list[str], id_pks: list[str], sigs: list[str],
                 num_shares: Any, threshold: Any, first_round: Any) -> dict[str, Any]:
    """An epoch's setup as the share request states it: what each cluster keeps, and the server with it
    (`first_round`: the round the `s` keys mask, the only one)."""
    return {"members": members, "c_pks": c_pks, "s_pks": s_pks, "id_pks": id_pks, "sigs": sigs,
            "num_shares": num_shares, "threshold": threshold, "first_round": first_round}


def setup_digest(setup: Mapping[str, Any]) -> str:
    """The epoch's setup as one cluster saw it (members, their keys and signatures, shares, threshold): every
    signature binds it, so a server that shows clusters different setups splits them into camps whose
    signatures do not count for each other."""
    return hashlib.sha256(json.dumps(dict(setup), sort_keys=True).encode()).hexdigest()


def upload_fields(*, federation: str, epoch: str, setup: str, server_round: int, round_set: Sequence[str],
                  member: str, keys: Mapping[str, int], digest: str) -> tuple:
    return (federation, epoch, setup, int(server_round), sorted(round_set), member,
            sorted([str(m), int(k)] for m, k in keys.items()), digest)


def view_fields(*, federation: str, epoch: str, setup: str, server_round: int, round_set: Sequence[str],
                survivors: Sequence[str]) -> tuple:
    return (federation, epoch, setup, int(server_round), sorted(round_set), sorted(survivors))


def valid_receipts(receipts: object, *, ids: Mapping[str, str], federation: str, epoch: str, setup: str,
                   server_round: int, round_set: Sequence[str], members: Sequence[str]) -> dict[str, dict[str, int]]:
    """Member -> the mask-key numbers its receipt binds (its own and its neighbours' in the round), for each of
    `members` whose receipt (digest, signature, keys) for this round is valid; the others are left out."""
    receipts = receipts if isinstance(receipts, Mapping) else {}
    out: dict[str, dict[str, int]] = {}
    for member in sorted(members):
        entry = receipts.get(member)
        if not (isinstance(entry, Sequence) and not isinstance(entry, str) and len(entry) == 3
                and isinstance(entry[0], str) and isinstance(entry[2], Mapping) and member in ids
                and all(isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
                        for k, v in entry[2].items())):
            continue
        if verify(ids[member], entry[1], "upload", *upload_fields(
                federation=federation, epoch=epoch, setup=setup, server_round=server_round, round_set=round_set,
                member=member, keys=entry[2], digest=entry[0])):
            out[member] = dict(entry[2])
    return out


def view_signers(signatures: object, *, ids: Mapping[str, str], federation: str, epoch: str, setup: str,
                 server_round: int, round_set: Sequence[str], survivors: Sequence[str]) -> set[str]:
    """The survivors whose signature of exactly this view is valid."""
    signatures = signatures if isinstance(signatures, Mapping) else {}
    fields = view_fields(federation=federation, epoch=epoch, setup=setup, server_round=server_round,
                         round_set=round_set, survivors=survivors)
    return {m for m in survivors if m in ids and verify(ids[m], signatures.get(m), "view", *fields)}


def uncertified(signers: set[str], *, me: str, dropped: set[str], neighbours: Mapping[str, Sequence[str]],
                threshold: int) -> str | None:
    """Why the view is not certified for holder `me`, or None: at least `threshold` signers among the share
    holders of `me` and among those of every dropped neighbour of `me` (a neighbourhood counts its centre)."""
    def around(c: str) -> set[str]:
        return {c, *neighbours[c]}

    if len(signers & around(me)) < threshold:
        return (f"{len(signers & around(me))} of this cluster's share holders signed the survivor set; "
                f"{threshold} must")
    for gone in sorted(dropped & set(neighbours[me])):
        if len(signers & around(gone)) < threshold:
            return (f"{len(signers & around(gone))} of the share holders of dropped cluster {gone} signed the "
                    f"survivor set; {threshold} must")
    return None


def json_map(value: Any) -> dict[str, Any]:
    """Evidence travels as a JSON object in a string (config records hold no maps); {} for anything else."""
    if not isinstance(value, str):
        return {}
    try:
        data = json.loads(value)
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}
