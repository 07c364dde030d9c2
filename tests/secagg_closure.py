"""What a server can compute from everything it holds after a SecAgg+ run: a symbolic adversary model.

Each upload of cluster c in round r is one linear equation over the integers mod 2^b:

    y_c^r = x_c^r + s_c^r + Σ_d sign(c, d) · p_{c,d}^r

Masks are opaque symbols; the caller says which ones the server knows (rebuilt self seeds, revealed pair keys,
pair masks derivable from a recovered private key: `known_from_shares` and `pair_symbols_from_keys` turn shares
and keys into symbols). Known symbols move to the left; what is left is y = A·x + M·m, with x the honest updates
(one variable per cluster and round) and m the unknown masks. The server can compute λᵀA·x exactly when
λᵀM = 0, so the combinations it learns are W = { λᵀA : λᵀM = 0 }, and `closure` reports

- every single update x_c^r in W, and
- every set C of honest clusters with |C| < threshold − |colluders| on whose updates (any rounds) some nonzero
  vector of W is supported: a sum the protocol promised to hide. Cross-round combinations count:
  x_j^1 − x_j^2 touches one cluster.

Nothing here is cryptography, and nothing is taken from the protocol code: the model is independent of it.

The algebra runs over GF(p), p = 2^61 − 1, with plain Python ints (sparse rows, exact Gaussian elimination).
The matrices hold 0 and ±1 only, and their ranks over GF(p) equal those over Q unless p divides every nonzero
minor of the size in question. Those minors are integers bounded by Hadamard's bound and, for these incidence-like
matrices, small in practice, so a 61-bit prime dividing them all would be a coincidence: negligible, though it is a
heuristic and not a proof for adversarial matrices. Reasoning over Q is itself a model of the real ring Z/2^b: a
combination with a non-unit coefficient (2·x) counts as fully determined here (conservative), while parity-only
leaks (λᵀM ≡ 0 mod 2 but not over Q) are outside the model; honest ±1 pair signs do not produce them.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

P = (1 << 61) - 1
"""The field the elimination runs in (a Mersenne prime)."""

Row = dict[int, int]
"""A sparse row: column -> nonzero coefficient mod P."""


@dataclass(frozen=True)
class Upload:
    """One cluster's masked upload in one round, as symbols."""

    round: int
    cluster: str
    self_symbol: str
    """The self mask's symbol (one fresh seed per upload in an honest run)."""
    pairs: Mapping[str, tuple[int, str]] = field(default_factory=dict)
    """Neighbour -> (sign, symbol) of the pair mask this upload carries for it. Uploads whose entries carry the same
    symbol share that mask, with the signs given here (the honest protocol uses +1 and −1; nothing assumes it)."""


@dataclass(frozen=True)
class Finding:
    """A set of honest clusters, smaller than the bound, that a determined combination is confined to."""

    clusters: frozenset[str]
    """A minimal such set: no proper subset carries a determined combination."""
    combinations: tuple[str, ...]
    """A basis of the determined combinations supported on these clusters' updates, readable."""


@dataclass(frozen=True)
class Report:
    """What `closure` found. `ok` is the verdict; the rest says why."""

    threshold: int
    colluders: frozenset[str]
    bound: int
    """threshold − |colluders|: the fewest honest clusters a determined combination may touch."""
    dim: int
    """How many independent combinations of honest updates the server can compute (for information)."""
    singles: tuple[str, ...]
    """Every single update the server can compute, e.g. "x[a@r1]" (a violation too while bound > 1)."""
    violations: tuple[Finding, ...]
    """Minimal honest-cluster sets below the bound that a determined combination is confined to."""

    @property
    def ok(self) -> bool:
        return not self.violations

    def __str__(self) -> str:
        lines = [
            f"threshold {self.threshold}, {len(self.colluders)} colluder(s): bound {self.bound} honest clusters; "
            f"{self.dim} independent combination(s) determined"
        ]
        if self.singles:
            lines.append("single updates determined: " + ", ".join(self.singles))
        for finding in self.violations:
            lines.append(f"VIOLATION {{{', '.join(sorted(finding.clusters))}}}: " + "; ".join(finding.combinations))
        return "\n".join(lines)


def known_from_shares(shares: Mapping[str, Collection[str]], *, holders_threshold: int) -> set[str]:
    """The secret symbols the server rebuilds: `shares` maps a secret to the holders whose share of it it has."""
    if holders_threshold < 1:
        raise ValueError(f"holders_threshold must be at least 1, got {holders_threshold}")
    return {secret for secret, holders in shares.items() if len(set(holders)) >= holders_threshold}


def pair_symbols_from_keys(derived_from: Mapping[str, Collection[str]], recovered: Collection[str]) -> set[str]:
    """The pair-mask symbols the server derives: `derived_from` maps a symbol to the private-key ids any one of
    which yields it (a pair mask follows from either party's private key and the other's public key)."""
    recovered = set(recovered)
    return {symbol for symbol, keys in derived_from.items() if recovered.intersection(keys)}


def closure(
    uploads: Iterable[Upload], *, known: Collection[str], threshold: int, colluders: Collection[str] = ()
) -> Report:
    """Everything the server can compute about honest updates from `uploads`, the mask symbols it knows (`known`)
    and the `colluders` (clusters whose updates and own symbols it holds), judged against `threshold`."""
    if threshold < 1:
        raise ValueError(f"threshold must be at least 1, got {threshold}")
    uploads = list(uploads)
    colluders = frozenset(colluders)
    seen: set[tuple[str, int]] = set()
    for up in uploads:
        if (up.cluster, up.round) in seen:
            raise ValueError(f"two uploads from cluster {up.cluster!r} in round {up.round}: one per round")
        seen.add((up.cluster, up.round))
        for neighbour, (sign, _) in up.pairs.items():
            if neighbour == up.cluster:
                raise ValueError(f"cluster {up.cluster!r} lists itself as a neighbour in round {up.round}")
            if sign not in (1, -1):
                raise ValueError(f"pair sign must be +1 or -1, got {sign!r} ({up.cluster!r}→{neighbour!r})")

    # A colluder's own symbols are known, and so are its updates: its equations carry nothing unknown.
    known = set(known)
    for up in uploads:
        if up.cluster in colluders:
            known.add(up.self_symbol)
            known.update(symbol for _, symbol in up.pairs.values())
    honest = sorted((up for up in uploads if up.cluster not in colluders), key=lambda u: (u.cluster, u.round))
    names = [f"x[{up.cluster}@r{up.round}]" for up in honest]
    owner = [up.cluster for up in honest]

    # Columns: x variables first (0..n-1), then one per unknown mask symbol.
    mask_col: dict[str, int] = {}
    rows: list[Row] = []
    for i, up in enumerate(honest):
        row: Row = {i: 1}
        terms = [(1, up.self_symbol), *up.pairs.values()]
        for sign, symbol in terms:
            if symbol in known:
                continue
            col = mask_col.setdefault(symbol, len(names) + len(mask_col))
            _add(row, col, sign)
        rows.append(row)

    masks = set(mask_col.values())
    basis = _echelon(rows, masks)
    w = {pivot: row for pivot, row in basis.items() if pivot not in masks}  # W, reduced echelon over x columns

    singles = tuple(names[pivot] for pivot, row in w.items() if len(row) == 1)
    violations = _violations(w, owner, names, threshold - len(colluders))
    return Report(
        threshold=threshold,
        colluders=colluders,
        bound=threshold - len(colluders),
        dim=len(w),
        singles=tuple(sorted(singles)),
        violations=violations,
    )


def _violations(w: dict[int, Row], owner: list[str], names: list[str], bound: int) -> tuple[Finding, ...]:
    """Minimal honest-cluster sets below `bound` that a vector of span(w) is confined to, found by checking the
    largest candidate sets (size bound − 1; a larger set covers its subsets) and shrinking each one that offends.
    If any set offends, at least one is listed; every minimal one is not guaranteed (one per offending candidate)."""
    if not w or bound <= 1:
        return ()
    # Only clusters whose updates some vector of W touches can matter; a set of the others never offends.
    touched = {col for row in w.values() for col in row}
    active = sorted({owner[col] for col in touched})
    cols_of = {c: {col for col in touched if owner[col] == c} for c in active}
    # W's orthogonal complement within the touched columns: one vector per free (non-pivot) column of w's RREF.
    # W has a nonzero vector on columns S iff the complement's vectors, cut down to S, have rank below |S|.
    kernel = [
        {free: 1} | {pivot: P - row[free] for pivot, row in w.items() if free in row}
        for free in sorted(touched - w.keys())
    ]

    def confined(clusters: Iterable[str]) -> list[Row]:
        """A basis of the vectors of W supported on these clusters' updates (empty when there are none)."""
        inside = set().union(*(cols_of[c] for c in clusters))
        outside = touched - inside
        return [row for pivot, row in _echelon(w.values(), outside).items() if pivot not in outside]

    def offends(clusters: Iterable[str]) -> bool:
        """Whether `confined` is nonempty, by whichever elimination is smaller."""
        inside = set().union(*(cols_of[c] for c in clusters))
        if len(w) ** 2 * len(touched) < len(kernel) * len(inside) ** 2:
            return bool(confined(clusters))
        cut = ({col: v for col, v in k.items() if col in inside} for k in kernel)
        return len(_echelon(cut, ())) < len(inside)

    found: dict[frozenset[str], list[Row]] = {}
    for candidate in itertools.combinations(active, min(bound - 1, len(active))):
        if not offends(candidate):
            continue
        support = set(candidate)
        # Drop clusters of sets already found first, to steer towards new ones. One pass gives a minimal set:
        # a set that cannot lose a cluster now cannot lose it later either (confinement is monotone).
        for cluster in sorted(candidate, key=lambda c: (not any(c in f for f in found), c)):
            if len(support) > 1 and offends(support - {cluster}):
                support.discard(cluster)
        found.setdefault(frozenset(support), confined(support))
    return tuple(
        Finding(clusters=clusters, combinations=tuple(_format(row, names) for row in vectors))
        for clusters, vectors in sorted(found.items(), key=lambda kv: (len(kv[0]), sorted(kv[0])))
    )


def _echelon(rows: Iterable[Row], preferred: Collection[int]) -> dict[int, Row]:
    """A reduced echelon basis of the rows' span, pivot column -> row (1 at its pivot, 0 at every other pivot),
    pivoting on `preferred` columns while a row has any. Rows pivoted elsewhere then have no preferred column, and
    they span exactly the combinations of the input rows that vanish on the preferred columns."""
    basis: dict[int, Row] = {}
    for original in rows:
        row = dict(original)
        for col in [c for c in row if c in basis]:  # basis rows are 0 at each other's pivots: one pass suffices
            _axpy(row, P - row[col], basis[col])
        if not row:
            continue
        pivot = min((c for c in row if c in preferred), default=None)
        if pivot is None:
            pivot = min(row)
        inverse = pow(row[pivot], P - 2, P)
        row = {c: v * inverse % P for c, v in row.items()}
        for other in basis.values():
            if pivot in other:
                _axpy(other, P - other[pivot], row)
        basis[pivot] = row
    return basis


def _add(row: Row, col: int, value: int) -> None:
    v = (row.get(col, 0) + value) % P
    if v:
        row[col] = v
    else:
        row.pop(col, None)


def _axpy(row: Row, factor: int, other: Row) -> None:
    """row += factor · other, in place."""
    for col, v in other.items():
        _add(row, col, factor * v)


def _rational(v: int) -> tuple[int, int]:
    """(a, b) with a/b ≡ v mod P and |a|, b small (rational reconstruction), for display."""
    r0, r1, t0, t1 = P, v % P, 0, 1
    while r1 * r1 * 2 > P:
        q = r0 // r1
        r0, r1, t0, t1 = r1, r0 - q * r1, t1, t0 - q * t1
    return (r1, t1) if t1 > 0 else (-r1, -t1)


def _format(row: Row, names: list[str]) -> str:
    """e.g. "x[a@r1] - x[a@r2]": terms in variable order, the first coefficient scaled to 1."""
    cols = sorted(row, key=lambda c: names[c])
    scale = pow(row[cols[0]], P - 2, P)
    text = ""
    for col in cols:
        a, b = _rational(row[col] * scale)
        sign = "-" if a < 0 else "+"
        a = abs(a)
        coef = "" if (a, b) == (1, 1) else f"{a}*" if b == 1 else f"{a}/{b}*"
        text += f" {sign} {coef}{names[col]}" if text else f"{'-' if sign == '-' else ''}{coef}{names[col]}"
    return text
