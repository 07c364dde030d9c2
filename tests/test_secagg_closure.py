"""The knowledge-closure checker on hand-built transcripts, and against an independent rank computation over Q."""

from __future__ import annotations

import itertools
import random
import re
import time

import pytest
import sympy
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.secagg_closure import Upload, closure, known_from_shares, pair_symbols_from_keys


def pair(a: str, b: str, r: int) -> str:
    lo, hi = sorted((a, b))
    return f"p[{lo}{hi}]@{r}"


def self_(c: str, r: int) -> str:
    return f"s[{c}]@{r}"


def masked_round(r: int, clusters: str, *, edges: str = "", uploaders: str = "", symbol=pair) -> list[Upload]:
    """One honest round over single-letter clusters: `edges` like "ab bc" (complete graph when empty), uploads
    from `uploaders` only (everyone when empty; the rest dropped after masking began). The lower id adds a pair
    mask, the higher subtracts it."""
    graph = [tuple(e) for e in edges.split()] or list(itertools.combinations(clusters, 2))
    uploads = []
    for c in uploaders or clusters:
        neighbours = [b for a, b in graph if a == c] + [a for a, b in graph if b == c]
        pairs = {d: (1 if c < d else -1, symbol(c, d, r)) for d in neighbours}
        uploads.append(Upload(r, c, self_(c, r), pairs))
    return uploads


def selves(r: int, clusters: str) -> set[str]:
    return {self_(c, r) for c in clusters}


# ---- known-safe ----


def test_nothing_revealed_nothing_determined():
    # Prepare
    uploads = masked_round(1, "abc")
    # Execute
    report = closure(uploads, known=set(), threshold=2)
    # Assert
    assert (report.dim, report.singles, report.ok) == (0, (), True)


def test_self_masks_revealed_give_only_the_full_sum():
    uploads = masked_round(1, "abc")
    for t in (1, 2, 3):
        report = closure(uploads, known=selves(1, "abc"), threshold=t)
        assert (report.dim, report.singles, report.ok) == (1, (), True), report
    # The same sum is too small once the threshold exceeds the three clusters that make it.
    report = closure(uploads, known=selves(1, "abc"), threshold=4)
    assert not report.ok
    [finding] = report.violations
    assert finding.clusters == {"a", "b", "c"}
    assert finding.combinations == ("x[a@r1] + x[b@r1] + x[c@r1]",)


# ---- known-leaky ----


def test_a_cluster_whose_every_mask_is_known_is_exposed():
    uploads = masked_round(1, "abc")
    known = {self_("a", 1), pair("a", "b", 1), pair("a", "c", 1)}
    report = closure(uploads, known=known, threshold=2)
    assert report.singles == ("x[a@r1]",)
    assert [(f.clusters, f.combinations) for f in report.violations] == [({"a"}, ("x[a@r1]",))]
    assert "VIOLATION {a}: x[a@r1]" in str(report)


# ---- dropouts ----


def test_a_dropout_handled_right_reveals_only_the_survivors_sum():
    # d dropped after masking began: survivors reveal their pair masks with d and the server rebuilds their seeds.
    uploads = masked_round(1, "abcd", uploaders="abc")
    known = selves(1, "abc") | {pair(c, "d", 1) for c in "abc"}
    report = closure(uploads, known=known, threshold=3)
    assert report.ok, report
    assert report.dim == 1
    assert closure(uploads, known=known, threshold=4).violations[0].combinations == ("x[a@r1] + x[b@r1] + x[c@r1]",)


def test_a_lying_server_that_splits_the_survivor_views_finds_a_single_update():
    # b and c are told a dropped (they reveal their pair masks with it); a's other holders are told a survived
    # (its self seed is rebuilt). d really dropped.
    uploads = masked_round(1, "abcd", uploaders="abc")
    known = selves(1, "abc") | {pair(c, "d", 1) for c in "abc"} | {pair("a", "b", 1), pair("a", "c", 1)}
    report = closure(uploads, known=known, threshold=3)
    assert report.singles == ("x[a@r1]",)
    assert not report.ok
    assert {"a"} in [f.clusters for f in report.violations]


# ---- several rounds of one key epoch (issue 30) ----


def epoch_of_two_rounds() -> list[Upload]:
    """Round 1: j's only neighbour is a; everyone uploads. Round 2: complete graph, a drops."""
    return masked_round(1, "abcj", edges="aj ab ac bc") + masked_round(2, "abcj", uploaders="bcj")


def settled_seeds() -> set[str]:
    # Round 1 settled honestly: every seed rebuilt from two of three holders. Round 2: survivors' seeds rebuilt.
    shares = {self_(c, 1): {"b", "c", "j"} for c in "abcj"} | {self_(c, 2): {"b", "c"} for c in "bcj"}
    return known_from_shares(shares, holders_threshold=2)


def test_one_private_key_for_the_whole_epoch_exposes_an_earlier_round():
    uploads = epoch_of_two_rounds()
    # Every pair mask of a, in both rounds, derives from a's one private key (or the neighbour's).
    derived = {pair("a", d, r): {"key:a", f"key:{d}"} for d in "bcj" for r in (1, 2)}
    derived |= {pair(c, d, 2): {f"key:{c}", f"key:{d}"} for c, d in ("bc", "bj", "cj")} | {
        pair("b", "c", 1): {"key:b", "key:c"}
    }
    # a dropped in round 2: its survivors hand over shares of its private key, which the server rebuilds.
    known = settled_seeds() | pair_symbols_from_keys(derived, recovered={"key:a"})
    report = closure(uploads, known=known, threshold=3)
    assert "x[j@r1]" in report.singles
    assert "x[a@r1]" in report.singles
    assert not report.ok


def test_fresh_keys_per_round_keep_an_earlier_round_hidden():
    uploads = epoch_of_two_rounds()
    derived = {pair("a", d, r): {f"key:a@{r}", f"key:{d}@{r}"} for d in "bcj" for r in (1, 2)}
    known = settled_seeds() | pair_symbols_from_keys(derived, recovered={"key:a@2"})
    assert pair("a", "j", 1) not in known and pair("a", "j", 2) in known
    report = closure(uploads, known=known, threshold=3)
    assert report.ok, report
    assert report.dim == 2  # the sum over round 1's four clusters, the sum over round 2's three survivors
    assert report.singles == ()


def test_a_pair_mask_reused_across_rounds_confines_a_cross_round_difference_to_two_clusters():
    # Path j - i - k - l: the only pair mask between {i, j} and {k, l} is i-k, and it is reused.
    def reuse_ik(a: str, b: str, r: int) -> str:
        return "q[ik]" if {a, b} == {"i", "k"} else pair(a, b, r)

    uploads = [u for r in (1, 2) for u in masked_round(r, "ijkl", edges="ij ik kl", symbol=reuse_ik)]
    known = selves(1, "ijkl") | selves(2, "ijkl")
    report = closure(uploads, known=known, threshold=3)
    assert not report.ok
    assert report.singles == ()
    findings = {f.clusters: f.combinations for f in report.violations}
    assert findings[frozenset("ij")] == ("x[i@r1] - x[i@r2] + x[j@r1] - x[j@r2]",)
    assert findings[frozenset("kl")] == ("x[k@r1] - x[k@r2] + x[l@r1] - x[l@r2]",)
    assert closure(uploads, known=known, threshold=2).ok  # two clusters is what a threshold of 2 allows
    # Control: the same schedule with a fresh i-k mask each round.
    fresh = [u for r in (1, 2) for u in masked_round(r, "ijkl", edges="ij ik kl")]
    assert closure(fresh, known=known, threshold=3).ok


# ---- signs as given ----


def test_the_signs_are_taken_as_given():
    def uploads(sign_b: int) -> list[Upload]:
        return [Upload(1, "a", "sa", {"b": (1, "m")}), Upload(1, "b", "sb", {"a": (sign_b, "m")})]

    honest = closure(uploads(-1), known={"sa", "sb"}, threshold=3)
    assert honest.violations[0].combinations == ("x[a@r1] + x[b@r1]",)
    same_sign = closure(uploads(1), known={"sa", "sb"}, threshold=3)
    assert same_sign.violations[0].combinations == ("x[a@r1] - x[b@r1]",)


# ---- collusion ----


def test_one_colluder_lowers_the_bound_by_one():
    uploads = masked_round(1, "abz")
    known = selves(1, "abz")
    # Without collusion the server holds only the sum over all three.
    alone = closure(uploads, known=known, threshold=3)
    assert (alone.dim, alone.ok) == (1, True)
    # With z: its pair masks are known and its update subtracted, leaving a + b.
    allowed = closure(uploads, known=known, threshold=3, colluders={"z"})
    assert (allowed.bound, allowed.dim, allowed.ok) == (2, 1, True)  # t - 1 honest clusters: allowed
    too_few = closure(uploads, known=known, threshold=4, colluders={"z"})
    assert too_few.bound == 3
    assert [(f.clusters, f.combinations) for f in too_few.violations] == [({"a", "b"}, ("x[a@r1] + x[b@r1]",))]


def test_a_colluders_own_symbols_count_as_known_without_being_listed():
    uploads = masked_round(1, "abz")
    # Only a's seed is known, but z colludes and a's only other mask is shared with b: a + b stays hidden.
    report = closure(uploads, known={self_("a", 1)}, threshold=2, colluders={"z"})
    assert (report.dim, report.ok) == (0, True)
    # Once b's seed is known too, a + b is determined: with t = 2 and one colluder, any one honest cluster may be.
    report = closure(uploads, known=selves(1, "ab"), threshold=2, colluders={"z"})
    assert (report.bound, report.dim, report.ok) == (1, 1, True)


def test_a_symbol_a_colluder_holds_unmasks_whoever_else_used_it():
    # a's self seed repeats z's (a reused seed); z colludes, so the server holds it.
    uploads = [
        Upload(1, "a", "s", {"b": (1, "p")}),
        Upload(1, "b", "sb", {"a": (-1, "p"), "z": (1, "q")}),
        Upload(1, "z", "s", {"b": (-1, "q")}),
    ]
    assert closure(uploads, known={"p"}, threshold=2).ok  # no collusion: the shared seed is unknown
    report = closure(uploads, known={"p"}, threshold=2, colluders={"z"})
    assert report.singles == ("x[a@r1]",)


# ---- helpers and argument checks ----


def test_known_from_shares_counts_distinct_holders():
    shares = {"s1": {"a", "b"}, "s2": ["a", "a", "b"], "s3": {"a", "b", "c"}}
    assert known_from_shares(shares, holders_threshold=3) == {"s3"}
    assert known_from_shares(shares, holders_threshold=2) == {"s1", "s2", "s3"}
    with pytest.raises(ValueError, match="holders_threshold"):
        known_from_shares(shares, holders_threshold=0)


def test_pair_symbols_follow_from_either_partys_key():
    derived = {"p_ab": {"ka", "kb"}, "p_bc": {"kb", "kc"}, "p_cd": {"kc", "kd"}}
    assert pair_symbols_from_keys(derived, recovered={"kb"}) == {"p_ab", "p_bc"}
    assert pair_symbols_from_keys(derived, recovered=set()) == set()


@pytest.mark.parametrize(
    ("uploads", "threshold", "message"),
    [
        ([Upload(1, "a", "s")], 0, "threshold"),
        ([Upload(1, "a", "s"), Upload(1, "a", "t")], 2, "two uploads"),
        ([Upload(1, "a", "s", {"a": (1, "m")})], 2, "itself"),
        ([Upload(1, "a", "s", {"b": (0, "m")})], 2, "sign"),
    ],
)
def test_malformed_transcripts_are_refused(uploads, threshold, message):
    with pytest.raises(ValueError, match=message):
        closure(uploads, known=set(), threshold=threshold)


# ---- against an independent computation over Q ----


def rank_over_q(uploads: list[Upload], known: set[str], drop=frozenset(), extra: dict | None = None) -> int:
    """rank [M | A] over the given (honest) uploads with the x columns in `drop` deleted, and with the row [0 | extra]
    appended when given (sympy, exact rationals)."""
    xs = sorted({(u.cluster, u.round) for u in uploads} - set(drop))
    symbols = sorted({s for u in uploads for s in [u.self_symbol, *(p for _, p in u.pairs.values())]} - known)
    rows = []
    for u in uploads:
        row = [0] * (len(symbols) + len(xs))
        for sign, s in [(1, u.self_symbol), *u.pairs.values()]:
            if s in symbols:
                row[symbols.index(s)] += sign
        if (u.cluster, u.round) in xs:
            row[len(symbols) + xs.index((u.cluster, u.round))] = 1
        rows.append(row)
    if extra is not None:
        rows.append([0] * len(symbols) + [extra.get(x, 0) for x in xs])
    return sympy.Matrix(rows).rank() if rows else 0


TERM = re.compile(r"([+-]?) ?(?:(\d+)(?:/(\d+))?\*)?x\[(\w+)@r(\d+)\]")


def parse(combination: str) -> dict[tuple[str, int], sympy.Rational]:
    """ "x[a@r1] - 2*x[b@r2]" -> {("a", 1): 1, ("b", 2): -2}"""
    return {
        (c, int(r)): (-1 if sign == "-" else 1) * sympy.Rational(int(a or 1), int(b or 1))
        for sign, a, b, c, r in TERM.findall(combination)
    }


@st.composite
def transcripts(draw):
    clusters = "abcd"[: draw(st.integers(2, 4))]
    rounds = draw(st.integers(1, 2))
    pool = [f"m{i}" for i in range(draw(st.integers(1, 8)))]  # a small pool: symbols get reused
    uploads = []
    for r in range(1, rounds + 1):
        for c in clusters:
            if draw(st.booleans()) and draw(st.booleans()):
                continue  # dropped this round
            neighbours = draw(st.sets(st.sampled_from([d for d in clusters if d != c])))
            pairs = {d: (draw(st.sampled_from([1, -1])), draw(st.sampled_from(pool))) for d in sorted(neighbours)}
            uploads.append(Upload(r, c, draw(st.sampled_from([*pool, f"s{c}{r}"])), pairs))
    everything = sorted({s for u in uploads for s in [u.self_symbol, *(p for _, p in u.pairs.values())]})
    known = draw(st.sets(st.sampled_from(everything))) if everything else set()
    colluders = draw(st.sets(st.sampled_from(clusters), max_size=1))
    return uploads, known, colluders, draw(st.integers(1, 5))


@settings(max_examples=60, deadline=None)
@given(transcripts())
def test_findings_match_ranks_over_q(case):
    uploads, known, colluders, threshold = case
    report = closure(uploads, known=known, threshold=threshold, colluders=colluders)
    # The reference drops colluders' uploads and knows every symbol they carry.
    known = known | {
        s for u in uploads if u.cluster in colluders for s in [u.self_symbol, *(p for _, p in u.pairs.values())]
    }
    uploads = [u for u in uploads if u.cluster not in colluders]
    variables = {(u.cluster, u.round) for u in uploads}
    full = rank_over_q(uploads, known)
    assert report.dim == full - rank_over_q(uploads, known, drop=variables)
    # A single x is determined iff deleting its column lowers rank [M | A].
    singles = {f"x[{c}@r{r}]" for c, r in variables if rank_over_q(uploads, known, drop={(c, r)}) < full}
    assert set(report.singles) == singles

    def offends(group) -> bool:
        return rank_over_q(uploads, known, drop={v for v in variables if v[0] in group}) < full

    clusters = sorted({c for c, _ in variables})
    offending = {
        frozenset(g)
        for n in range(1, threshold - len(colluders))
        for g in itertools.combinations(clusters, n)
        if offends(g)
    }
    minimal = {g for g in offending if not any(h < g for h in offending)}
    found = {f.clusters for f in report.violations}
    assert found <= minimal
    assert bool(found) == bool(minimal)  # something offends iff something is reported
    for finding in report.violations:  # each combination shown is one the server can compute, on those clusters
        for combination in finding.combinations:
            vector = parse(combination)
            assert vector and {c for c, _ in vector} <= finding.clusters
            assert rank_over_q(uploads, known, extra=vector) == full, combination


# ---- size ----


def test_ten_clusters_six_rounds_complete_graph_is_fast():
    clusters = "abcdefghij"
    uploads = [u for r in range(1, 7) for u in masked_round(r, clusters)]
    pair_symbols = sorted({p for u in uploads for _, p in u.pairs.values()})
    assert (len(uploads), len(pair_symbols)) == (60, 270)
    # CPU time, not wall time: a busy shared machine must not fail this.
    # Every seed rebuilt (rounds settled honestly) and half the pair masks known: a few updates exposed.
    half = {u.self_symbol for u in uploads} | set(random.Random(2).sample(pair_symbols, len(pair_symbols) // 2))
    start = time.process_time()
    report = closure(uploads, known=half, threshold=6)
    elapsed = time.process_time() - start
    assert report.dim > 6 and not report.ok  # more than the six round sums: the run did real work
    assert elapsed < 2.0, f"{elapsed:.2f} s\n{report}"
    # Everything known, the worst case for the search: every update is exposed.
    start = time.process_time()
    report = closure(uploads, known=half | set(pair_symbols), threshold=6)
    elapsed = time.process_time() - start
    assert (report.dim, len(report.singles), len(report.violations)) == (60, 60, 10)
    assert elapsed < 2.0, f"{elapsed:.2f} s"
