"""Rebuilding a secret from holders' shares when some of them may be wrong.

A holder may answer with a share that is malformed, belongs to someone else, or is simply false (a faulty
or lying cluster, or a network that tampers with a plaintext reply). Every secret the server rebuilds can
be checked (a self-mask seed against its uploader's commitment, a mask key against its public key), so
the server tries groups of `threshold` shares until one rebuilds a secret that passes, then tests each
remaining share against that group: a wrong share names its holder, who is dropped with the reason.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping

from nebula_fl.secagg.shares import ShareError, combine

MAX_GROUPS = 256  # groups of `threshold` shares tried before giving up (C(8, 4) = 70)


def rebuild(shares: Mapping[str, bytes], *, threshold: int, check: Callable[[bytes], bool]
            ) -> tuple[bytes, set[str]]:
    """(the secret, holders whose share is wrong); ShareError if no group of `threshold` shares rebuilds it."""
    holders = sorted(shares)
    if len(holders) < threshold:
        raise ShareError(f"{len(holders)} share(s), fewer than the {threshold} that rebuild the secret")
    good: tuple[str, ...] | None = None
    for group in itertools.islice(itertools.combinations(holders, threshold), MAX_GROUPS):
        if _rebuilds(shares, group, check) is not None:
            good = group
            break
    if good is None:
        raise ShareError(f"no {threshold} of the {len(holders)} shares rebuild a secret that passes its check")
    secret = _rebuilds(shares, good, check)
    assert secret is not None
    wrong = {h for h in holders if h not in good and _rebuilds(shares, (*good[1:], h), check) is None}
    return secret, wrong


def _rebuilds(shares: Mapping[str, bytes], group: tuple[str, ...], check: Callable[[bytes], bool]) -> bytes | None:
    pieces = [shares[h] for h in group]
    sizes = {len(p) for p in pieces}
    if len(sizes) != 1 or (min(sizes) - 4) % 16 or min(sizes) < 20 or len({p[:4] for p in pieces}) != len(pieces):
        return None  # Flower's shares: a 4-byte index, then 16 bytes per chunk; one length, distinct indices
    try:
        secret = combine(pieces)
    except ShareError:
        return None
    return secret if check(secret) else None
