"""The neighbour graph of SecAgg+: each cluster shares its secrets with k neighbours, not with everyone.

A Harary graph H(k, m) on the epoch's members in a seeded order: member p is joined to p ± 1 .. p ± k/2
(and, for odd k with m even, to the member opposite it). It is k-regular and k-connected, so any
k - 1 dropouts leave every survivor reachable. k >= m - 1 is the complete graph. For odd k and odd m
no k-regular graph exists; k + 1 is used instead.
"""

from __future__ import annotations

import hashlib


def degree_for(members: int, num_shares: int) -> int:
    """Neighbours per member for `num_shares` shares (itself included; 0 = all members)."""
    if members < 1:
        raise ValueError("a graph needs at least one member")
    if num_shares == 0 or num_shares - 1 >= members - 1:
        return members - 1
    k = max(2, num_shares - 1)  # fewer than 2 neighbours is a matching: a pair's sum would be unmasked
    if k % 2 and members % 2:
        k += 1
    return min(k, members - 1)


def neighbours(members: list[str], *, num_shares: int, seed: str) -> dict[str, tuple[str, ...]]:
    """Each member's neighbours (itself excluded), sorted; the same on every side for the same inputs."""
    if len(set(members)) != len(members):
        raise ValueError("graph members must be distinct")
    m = len(members)
    k = degree_for(m, num_shares)
    order = sorted(members, key=lambda c: hashlib.sha256(f"{seed}/{c}".encode()).digest())
    out: dict[str, set[str]] = {c: set() for c in members}
    if k >= m - 1:
        for c in members:
            out[c] = set(members) - {c}
    else:
        for p, c in enumerate(order):
            for d in range(1, k // 2 + 1):
                out[c].update({order[(p + d) % m], order[(p - d) % m]})
            if k % 2:
                out[c].add(order[(p + m // 2) % m])
    return {c: tuple(sorted(n, key=_key)) for c, n in out.items()}


def _key(cid: str) -> tuple[int, str]:
    return (int(cid), cid) if cid.isascii() and cid.isdigit() else (1 << 62, cid)
