"""The pure maths of secure aggregation (nebula_fl/secagg), checked against independent references.

References are computed here, not by the code under test: the field's levels and signed readings with
Python integers, sums with numpy float64, the mask stream against RFC 8439's ChaCha20 vectors and against
`cryptography` used another way, graph connectivity by brute force, shares by reconstruction from subsets.
"""

from __future__ import annotations

import base64
import itertools
import json
from collections import deque

import numpy as np
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nebula_fl.secagg.field import BITS, FieldCode, FieldError, add, decode_sum, encode, pack, subtract, unpack
from nebula_fl.secagg.graph import degree_for, neighbours
from nebula_fl.secagg.masks import KEY_BYTES, expand, pair_order, pair_sign, round_key
from nebula_fl.secagg.shares import (
    KeyPair,
    ShareError,
    check_public,
    combine,
    fernet_key,
    pair_secret,
    seal,
    split,
    unseal,
)

try:
    from scipy.stats import chi2

    CHI2_999_255 = float(chi2.ppf(0.999, 255))
except ImportError:  # the 0.999 quantile of chi-square with 255 degrees of freedom
    CHI2_999_255 = 330.52

FEW = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ALL_BITS = (16, 24, 32, 40, 48, 56, 64)

# RFC 8439 appendix A.1, test vectors #1 and #2: the ChaCha20 blocks of the all-zero key and nonce, counters 0 and 1.
RFC8439_A1_ZERO_KEY_BLOCKS_0_1 = bytes.fromhex(
    "76b8e0ada0f13d90405d6ae55386bd28bdd219b8a08ded1aa836efcc8b770dc7"
    "da41597c5157488d7724e03fb8d84a376a43b8f41518a11cc387b669b2ee6586"
    "9f07e7be5551387a98ba977c732d080dcb0f29a048e3656912c6533e32ee7aed"
    "29b721769ce64e43d57133b074d839d531ed1f28510afb45ace10a1f4b794d6f"
)
# RFC 8439 §2.4.2: key 00..1f, nonce 00:00:00:00:00:00:00:4a:00:00:00:00, initial counter 1.
RFC8439_242_PLAINTEXT = (b"Ladies and Gentlemen of the class of '99: If I could offer you only one tip for the future, "
                         b"sunscreen would be it.")
RFC8439_242_CIPHERTEXT = bytes.fromhex(
    "6e2e359a2568f98041ba0728dd0d6981e97e7aec1d4360c20a27afccfd9fae0b"
    "f91b65c5524733ab8f593dabcd62b3571639d624e65152ab8f530c359f0861d8"
    "07ca0dbf500d6a6156a38e088a22b65e52bc514d16ccf806818ce91ab7793736"
    "5af90bbf74a35be6b40b8eedf2785e42874d"
)


# ---- independent references ----

def ref_levels(bits: int, clusters: int) -> int:
    """L = floor((2^(b-1) - 1) / clusters), in Python integers."""
    return ((1 << (bits - 1)) - 1) // clusters


def signed(values: np.ndarray, bits: int) -> list[int]:
    """Field elements read as signed b-bit integers (two's complement), in Python integers."""
    out = []
    for v in values.tolist():
        v = int(v) % (1 << bits)
        out.append(v - (1 << bits) if v >= 1 << (bits - 1) else v)
    return out


def field_sum(vectors: list[np.ndarray], bits: int) -> np.ndarray:
    """Σ vectors mod 2^b with numpy's wrapping uint64 arithmetic, not the module's `add`."""
    total = np.zeros_like(vectors[0], dtype=np.uint64)
    for v in vectors:
        total = total + v.astype(np.uint64)
    return total & np.uint64((1 << bits) - 1)


def code_for(bits: int, *, clusters: int, clip: float = 1.0, max_weight: int = 1000) -> FieldCode:
    return FieldCode(bits=bits, clip=clip, max_weight=min(max_weight, ref_levels(bits, clusters)), clusters=clusters)


def step_of(code: FieldCode) -> float:
    """clip · max_weight / L, with L as the formula gives it up to 48 bits (float64-exact levels above)."""
    levels = ref_levels(code.bits, code.clusters) if code.bits <= 48 else code.levels
    return code.clip * code.max_weight / levels


def chi_square_bytes(data: bytes) -> float:
    counts = np.bincount(np.frombuffer(data, dtype=np.uint8), minlength=256).astype(np.float64)
    expected = len(data) / 256
    return float(((counts - expected) ** 2 / expected).sum())


def connected(nodes: set[str], edges: dict[str, tuple[str, ...]]) -> bool:
    if not nodes:
        return True
    start = next(iter(nodes))
    seen, todo = {start}, deque([start])
    while todo:
        for n in edges[todo.popleft()]:
            if n in nodes and n not in seen:
                seen.add(n)
                todo.append(n)
    return seen == nodes


# ---- field: bounds ----

def test_levels_and_step_follow_the_stated_formula():
    assert tuple(BITS) == ALL_BITS
    for bits, clusters in itertools.product(ALL_BITS, (1, 2, 3, 7, 1000, 1 << 20)):
        if ref_levels(bits, clusters) < 1:
            continue
        code = FieldCode(bits=bits, clip=0.25, max_weight=1, clusters=clusters)
        assert 1 <= code.levels <= ref_levels(bits, clusters) and clusters * code.levels <= (1 << (bits - 1)) - 1
        # encode computes w·x/step in float64: every level must be exact there, or ±L rounds past L and wraps
        assert code.levels <= 1 << 53 and float(code.levels) == code.levels, (bits, clusters, code.levels)
        if bits <= 48:  # no float64 limit in play: the stated formula exactly, so clusters + 1 inputs overflow
            assert code.levels == ref_levels(bits, clusters)
            assert (1 << (bits - 1)) - 1 < clusters * (code.levels + 1)
        assert code.step == pytest.approx(0.25 / code.levels, rel=1e-15)


@pytest.mark.parametrize("bits", ALL_BITS)
@pytest.mark.parametrize("clusters", [1, 2, 3, 7, 64])
@pytest.mark.parametrize("sign", [1, -1])
def test_sum_at_the_bound_is_exact(bits, clusters, sign):
    """`clusters` inputs all at ±clip with the largest weight sum to ±clusters·L: no wrap, no overshoot.

    (w·x/step is computed in float64 and may land an ULP inside ±L, so an input may round to L - 1: the
    sum is checked to lie in [clusters·(L - 1), clusters·L], and to decode within one step per input.)"""
    clip = 0.75
    code = code_for(bits, clusters=clusters, clip=clip)
    levels = code.levels  # checked against the formula above
    rng = np.random.default_rng(bits * 1000 + clusters)
    x = sign * np.array([clip, 10 * clip, 1e30])  # at the clip, and far past it (clipped to it)
    total = field_sum([encode(x, weight=code.max_weight, code=code, rng=rng) for _ in range(clusters)], bits)
    *ints, weight_int = signed(total, bits)
    assert weight_int == clusters * code.max_weight
    assert all(clusters * (levels - 1) <= sign * v <= clusters * levels for v in ints), (ints, clusters * levels)
    sums, weight = decode_sum(total, code=code)
    assert weight == clusters * code.max_weight
    expected = sign * clusters * clip * code.max_weight
    assert np.all(np.sign(sums) == sign)
    np.testing.assert_allclose(sums, expected, rtol=0, atol=clusters * step_of(code) * (1 + 1e-9))
    np.testing.assert_allclose(sums, expected, rtol=1 / levels + 1e-12)  # each input is at most 1 of L units short


@pytest.mark.parametrize("bits", [16, 24, 32, 40, 48])
@pytest.mark.parametrize("clusters", [1, 3])
def test_one_input_past_the_bound_wraps(bits, clusters):
    """The bound is tight: clusters + 1 inputs at +clip with weight L wrap to a negative sum and weight.
    (Up to 48 bits, where L is the formula's; wider fields may hold fewer levels than they could.)"""
    code = FieldCode(bits=bits, clip=1.0, max_weight=ref_levels(bits, clusters), clusters=clusters)
    rng = np.random.default_rng(bits)
    enc = encode(np.array([1.0]), weight=code.max_weight, code=code, rng=rng)
    sums, weight = decode_sum(field_sum([enc] * (clusters + 1), bits), code=code)
    assert sums[0] < 0 and weight < 0


@pytest.mark.parametrize("bits", [0, 8, 15, 17, 31, 33, 63, 65, 72, 128, -16])
def test_field_code_refuses_bits(bits):
    with pytest.raises(FieldError, match="bits"):
        FieldCode(bits=bits, clip=1.0, max_weight=1, clusters=1)


@pytest.mark.parametrize("clip", [0.0, -0.0, -1.0, float("nan"), float("inf"), float("-inf")])
def test_field_code_refuses_clip(clip):
    with pytest.raises(FieldError, match="clipping range"):
        FieldCode(bits=32, clip=clip, max_weight=1, clusters=1)


@pytest.mark.parametrize("bits", ALL_BITS)
@pytest.mark.parametrize("clusters", [1, 5, 1000])
def test_field_code_refuses_a_weight_bound_past_l(bits, clusters):
    levels = FieldCode(bits=bits, clip=1.0, max_weight=1, clusters=clusters).levels
    assert FieldCode(bits=bits, clip=1.0, max_weight=levels, clusters=clusters).levels == levels
    for bad in (levels + 1, 2 * levels, 0, -1):
        with pytest.raises(FieldError):
            FieldCode(bits=bits, clip=1.0, max_weight=bad, clusters=clusters)


@pytest.mark.parametrize("clusters", [0, -1, (1 << 20) + 1])
def test_field_code_refuses_cluster_counts(clusters):
    with pytest.raises(FieldError, match="clusters"):
        FieldCode(bits=64, clip=1.0, max_weight=1, clusters=clusters)


@pytest.mark.parametrize("weight", [-1, 101, 2.0, True, "3", None])
def test_encode_refuses_bad_weights(weight):
    code = FieldCode(bits=32, clip=1.0, max_weight=100, clusters=2)
    with pytest.raises(FieldError, match="weight"):
        encode(np.zeros(3), weight=weight, code=code, rng=np.random.default_rng(0))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_encode_refuses_non_finite_updates(bad):
    code = FieldCode(bits=32, clip=1.0, max_weight=100, clusters=2)
    with pytest.raises(FieldError, match="NaN or Inf"):
        encode(np.array([0.0, bad]), weight=3, code=code, rng=np.random.default_rng(0))


# ---- field: rounding ----

@pytest.mark.parametrize("bits", ALL_BITS)
def test_stochastic_rounding_is_unbiased(bits):
    """20,000 encodings of one x between grid points average to w·x/step within a few standard errors."""
    clusters, weight, clip = 3, 7, 2.0
    code = code_for(bits, clusters=clusters, clip=clip, max_weight=50)
    step = step_of(code)
    target = weight * code.levels // (3 * code.max_weight) + 0.3  # large: precision near the top
    x = target * step / weight
    draws = 20_000
    q = np.array(signed(encode(np.full(draws, x), weight=weight, code=code, rng=np.random.default_rng(bits))[:-1],
                        bits), dtype=np.float64)
    expected = weight * x / step
    assert set(np.unique(q - np.floor(expected))) <= {0.0, 1.0}, "every draw is one of the two grid points"
    frac = expected - np.floor(expected)
    stderr = np.sqrt(frac * (1 - frac) / draws)
    assert abs(q.mean() - expected) <= 5 * stderr, (q.mean(), expected, stderr)


@FEW
@given(bits=st.sampled_from(ALL_BITS), clusters=st.integers(1, 9), max_weight=st.integers(1, 10_000),
       clip=st.floats(1e-3, 1e3), seed=st.integers(0, 2**32 - 1), data=st.data())
def test_each_encoding_is_within_one_step(bits, clusters, max_weight, clip, seed, data):
    code = code_for(bits, clusters=clusters, clip=clip, max_weight=max_weight)
    weight = data.draw(st.integers(0, code.max_weight), label="weight")
    rng = np.random.default_rng(seed)
    x = rng.uniform(-2 * clip, 2 * clip, size=64)
    x[:4] = [clip, -clip, 0.0, 3 * clip]
    sums, w = decode_sum(encode(x, weight=weight, code=code, rng=rng), code=code)
    step = step_of(code)
    assert w == weight
    reference = weight * np.clip(x, -clip, clip)
    err = np.abs(sums - reference)
    slack = 8 * np.spacing(np.abs(reference))  # float64 rounding of w·x and q·step themselves, not of the encoding
    assert np.all(err <= step + slack), ((err / step).max(), bits)


def pair_masks(ids: list[str], *, bits: int, count: int, server_round: int) -> dict[str, np.ndarray]:
    """Each member's net pairwise mask Σ_j ±expand(round_key(secret_ij)), with fresh EC key pairs, each member's
    numbered differently (as mask keys of members that dropped out of different rounds are)."""
    code = FieldCode(bits=bits, clip=1.0, max_weight=1, clusters=1)
    pairs = {c: KeyPair.generate() for c in ids}
    seqs = {c: i * 3 % 5 for i, c in enumerate(ids)}
    out = {}
    for c in ids:
        terms = [np.zeros(count, dtype=np.uint64)]
        for o in ids:
            if o != c:
                key = round_key(pair_secret(pairs[c].private_pem, pairs[o].public), epoch="e1", server_round=server_round,
                                seqs=pair_order(c, o, seqs[c], seqs[o]))
                m = expand(key, count=count, code=code)
                terms.append(m if pair_sign(c, o) > 0 else np.uint64(0) - m)
        out[c] = field_sum(terms, bits)
    return out


@pytest.mark.parametrize("n", [3, 5, 8])
@pytest.mark.parametrize("bits", [16, 32, 48])
def test_masked_sum_equals_the_plain_weighted_sum(n, bits):
    """Pair masks cancel, self masks are removed: the decoded sum is Σ wᵢ·clip(xᵢ) within n·step."""
    rng = np.random.default_rng(n * 100 + bits)
    clip, size = 0.5, 200
    code = code_for(bits, clusters=n, clip=clip, max_weight=500)
    ids = [str(i) for i in rng.permutation(n) * 7 + 1]
    xs = rng.normal(0, 0.4, size=(n, size))
    weights = [int(w) for w in rng.integers(0, code.max_weight + 1, size=n)]
    pmask = pair_masks(ids, bits=bits, count=size + 1, server_round=4)
    seeds = [rng.bytes(KEY_BYTES) for _ in range(n)]
    uploads = [field_sum([encode(xs[i], weight=weights[i], code=code, rng=rng), pmask[c],
                          expand(seeds[i], count=size + 1, code=code)], bits) for i, c in enumerate(ids)]
    total = field_sum(uploads, bits)
    for seed in seeds:
        total = (total - expand(seed, count=size + 1, code=code)) & np.uint64((1 << bits) - 1)
    sums, weight = decode_sum(total, code=code)
    reference = (np.asarray(weights, dtype=np.float64)[:, None] * np.clip(xs, -clip, clip)).sum(axis=0)
    assert weight == sum(weights)
    step = step_of(code)
    assert np.abs(sums - reference).max() <= n * step * (1 + 1e-6)


@FEW
@given(bits=st.sampled_from(ALL_BITS), a=st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=20), data=st.data())
def test_add_and_subtract_are_arithmetic_mod_2_to_the_b(bits, a, data):
    b = data.draw(st.lists(st.integers(0, 2**64 - 1), min_size=len(a), max_size=len(a)), label="b")
    code = FieldCode(bits=bits, clip=1.0, max_weight=1, clusters=1)
    va, vb = np.array(a, dtype=np.uint64), np.array(b, dtype=np.uint64)
    assert add(va, vb, code=code).tolist() == [(x + y) % (1 << bits) for x, y in zip(a, b, strict=True)]
    assert subtract(va, vb, code=code).tolist() == [(x - y) % (1 << bits) for x, y in zip(a, b, strict=True)]


# ---- field: packing ----

@pytest.mark.parametrize("bits", ALL_BITS)
def test_pack_unpack_round_trip_matches_a_bytewise_reference(bits):
    rng = np.random.default_rng(bits)
    v = rng.integers(0, 2**63, size=257, dtype=np.uint64) * np.uint64(2) + rng.integers(0, 2, size=257, dtype=np.uint64)
    v &= np.uint64((1 << bits) - 1)
    v[:3] = [0, (1 << bits) - 1, 1 << (bits - 1)]
    data = pack(v, bits=bits)
    assert data == b"".join(int(e).to_bytes(bits // 8, "little") for e in v.tolist())
    back = unpack(data, bits=bits, count=v.size)
    assert back.dtype == np.uint64 and np.array_equal(back, v)
    assert np.array_equal(unpack(np.frombuffer(data, dtype=np.uint8), bits=bits, count=v.size), v)


@pytest.mark.parametrize("bits", ALL_BITS)
def test_unpack_of_a_wrong_size_raises(bits):
    data = pack(np.arange(10, dtype=np.uint64), bits=bits)
    for bad in (data[:-1], data + b"\0", b"", data + data):
        with pytest.raises(FieldError, match="expected 10 elements"):
            unpack(bad, bits=bits, count=10)
    with pytest.raises(FieldError):
        unpack(data, bits=bits, count=11)


# ---- masks ----

@pytest.mark.parametrize("bits", ALL_BITS)
def test_expand_is_the_rfc8439_keystream(bits):
    """Zero key, zero nonce, counter 0: expand reads RFC 8439's A.1 blocks as little-endian words."""
    code = FieldCode(bits=bits, clip=1.0, max_weight=1, clusters=1)
    width = 4 if bits <= 32 else 8
    count = len(RFC8439_A1_ZERO_KEY_BLOCKS_0_1) // width
    words = [int.from_bytes(RFC8439_A1_ZERO_KEY_BLOCKS_0_1[i * width:(i + 1) * width], "little") for i in range(count)]
    got = expand(bytes(KEY_BYTES), count=count, code=code)
    assert got.dtype == np.uint64
    assert got.tolist() == [w % (1 << bits) for w in words]


def test_cryptography_chacha20_nonce_layout_is_counter_then_nonce():
    """RFC 8439 §2.4.2 with `cryptography`'s 16-byte nonce = counter (LE u32) + 12-byte nonce: the
    assumption behind expand's all-zero nonce meaning counter 0 and nonce 0."""
    nonce = (1).to_bytes(4, "little") + bytes.fromhex("000000000000004a00000000")
    enc = Cipher(algorithms.ChaCha20(bytes(range(32)), nonce), mode=None).encryptor()
    assert enc.update(RFC8439_242_PLAINTEXT) == RFC8439_242_CIPHERTEXT


@FEW
@given(key=st.binary(min_size=KEY_BYTES, max_size=KEY_BYTES), bits=st.sampled_from(ALL_BITS),
       count=st.integers(1, 300))
def test_expand_equals_the_keystream_recovered_from_a_known_plaintext(key, bits, count):
    code = FieldCode(bits=bits, clip=1.0, max_weight=1, clusters=1)
    width = 4 if bits <= 32 else 8
    plain = bytes(range(256)) * (count * width // 256 + 1)
    cipher = Cipher(algorithms.ChaCha20(key, bytes(16)), mode=None).encryptor().update(plain[:count * width])
    stream = bytes(a ^ b for a, b in zip(cipher, plain, strict=False))
    words = [int.from_bytes(stream[i * width:(i + 1) * width], "little") % (1 << bits) for i in range(count)]
    assert expand(key, count=count, code=code).tolist() == words


@pytest.mark.parametrize("size", [0, 16, 31, 33, 64])
def test_expand_refuses_keys_of_the_wrong_size(size):
    with pytest.raises(ValueError, match="32 bytes"):
        expand(bytes(size), count=4, code=FieldCode(bits=32, clip=1.0, max_weight=1, clusters=1))


def one_upload(bits: int, *, server_round: int, masked: bool = True, rng_seed: int = 5) -> bytes:
    """One cluster's packed upload: its encoded update (small values: far from uniform bytes) plus, when
    masked, its self mask and its masks with two neighbours, for a fixed round (deterministic)."""
    code = FieldCode(bits=bits, clip=1.0, max_weight=50, clusters=4)
    count = (1 << 15) // (bits // 8)
    rng = np.random.default_rng(rng_seed)
    parts = [encode(rng.normal(0, 0.01, count - 1), weight=37, code=code, rng=rng)]
    if masked:
        me = "2"
        for other, secret in (("1", b"\x11" * 32), ("3", b"\x33" * 32)):
            m = expand(round_key(secret, epoch="e1", server_round=server_round, seqs=(0, 0)), count=count, code=code)
            parts.append(m if pair_sign(me, other) > 0 else np.uint64(0) - m)
        parts.append(expand(round_key(b"\x22" * 32, epoch="e1", server_round=server_round, seqs=(0, 0),
                                      purpose="self-mask"), count=count, code=code))
    return pack(field_sum(parts, bits), bits=bits)


@pytest.mark.parametrize("bits", ALL_BITS)
def test_a_masked_upload_has_uniform_bytes(bits):
    data = one_upload(bits, server_round=3)
    assert len(data) == (1 << 15) // (bits // 8) * (bits // 8)
    assert chi_square_bytes(data) < CHI2_999_255


@pytest.mark.parametrize("bits", ALL_BITS)
def test_an_unmasked_upload_does_not_have_uniform_bytes(bits):
    """The uniformity test has power: the same update without its masks fails it by far."""
    assert chi_square_bytes(one_upload(bits, server_round=3, masked=False)) > 10 * CHI2_999_255


@pytest.mark.parametrize("bits", [16, 32, 64])
def test_two_rounds_of_the_same_update_are_unrelated(bits):
    r1, r2 = one_upload(bits, server_round=1), one_upload(bits, server_round=2)
    agree = int(np.count_nonzero(np.frombuffer(r1, np.uint8) == np.frombuffer(r2, np.uint8)))
    n = len(r1)
    mean, sd = n / 256, np.sqrt(n * (1 / 256) * (255 / 256))
    assert abs(agree - mean) <= 5 * sd, (agree, mean)
    plain1 = one_upload(bits, server_round=1, masked=False, rng_seed=5)
    plain2 = one_upload(bits, server_round=2, masked=False, rng_seed=6)
    assert np.mean(np.frombuffer(plain1, np.uint8) == np.frombuffer(plain2, np.uint8)) > 10 / 256  # unmasked: related


def test_round_key_separates_rounds_epochs_purposes_secrets_and_key_numbers():
    secrets = [b"\x01" * 32, b"\x02" * 32, bytes(32)]
    keys = {}
    for secret, epoch, rnd, seqs, purpose in itertools.product(secrets, ["e1", "e2", "E1"], [0, 1, 2, 10, 11],
                                                               [(0, 0), (0, 1), (1, 0), (1, 1), (1, 10), (11, 0)],
                                                               ["pair-mask", "self-mask"]):
        k = round_key(secret, epoch=epoch, server_round=rnd, seqs=seqs, purpose=purpose)
        assert isinstance(k, bytes) and len(k) == KEY_BYTES
        assert k == round_key(secret, epoch=epoch, server_round=rnd, seqs=seqs, purpose=purpose)
        keys[secret, epoch, rnd, seqs, purpose] = k
    assert len(set(keys.values())) == len(keys)
    assert round_key(secrets[0], epoch="e1", server_round=3, seqs=(2, 4)) == round_key(
        secrets[0], epoch="e1", server_round=3, seqs=(2, 4), purpose="pair-mask")
    # the numbers are bound as integers: a numpy integer derives the key a Python one does
    assert round_key(secrets[0], epoch="e1", server_round=3, seqs=(0, 0)) == round_key(
        secrets[0], epoch="e1", server_round=3, seqs=(np.int64(0), 0))


def test_both_sides_of_a_pair_agree_and_other_pairs_do_not():
    a, b, c = KeyPair.generate(), KeyPair.generate(), KeyPair.generate()
    ab, ba = pair_secret(a.private_pem, b.public), pair_secret(b.private_pem, a.public)
    assert ab == ba and len(ab) == 32
    assert ab != pair_secret(a.private_pem, c.public) != pair_secret(b.private_pem, c.public)
    assert fernet_key(a.private_pem, b.public) == fernet_key(b.private_pem, a.public)
    assert base64.urlsafe_b64decode(fernet_key(a.private_pem, b.public)) == ab
    assert round_key(ab, epoch="e", server_round=5, seqs=(0, 0)) == round_key(ba, epoch="e", server_round=5, seqs=(0, 0))
    # each side passes its own key number first to pair_order: both derive the same round key, whoever is lower
    for me, other in (("3", "12"), ("12", "3"), ("a", "3")):
        mine, theirs = 2, 7
        assert pair_order(me, other, mine, theirs) == pair_order(other, me, theirs, mine)
        assert round_key(ab, epoch="e", server_round=5, seqs=pair_order(me, other, mine, theirs)) == round_key(
            ba, epoch="e", server_round=5, seqs=pair_order(other, me, theirs, mine))
    # a side that took the other's number for its own derives another key: the numbers are bound in order
    assert round_key(ab, epoch="e", server_round=5, seqs=(2, 7)) != round_key(ab, epoch="e", server_round=5, seqs=(7, 2))
    # The private PEM is the key whose public half was published.
    assert a.private.public_key().public_bytes(serialization.Encoding.PEM,
                                               serialization.PublicFormat.SubjectPublicKeyInfo) == a.public


numeric_ids = st.integers(0, 10**20).map(str)
ascii_ids = st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=12)


@FEW
@given(a=st.one_of(numeric_ids, ascii_ids), b=st.one_of(numeric_ids, ascii_ids))
def test_pair_sign_is_antisymmetric(a, b):
    if a == b:
        return
    assert pair_sign(a, b) in (1, -1)
    assert pair_sign(a, b) == -pair_sign(b, a)


def test_pair_sign_orders_numeric_ids_as_numbers():
    assert pair_sign("2", "10") == 1 and pair_sign("10", "2") == -1  # as strings "10" < "2"
    assert pair_sign("9", "node-a") == 1 and pair_sign("node-a", "9") == -1
    assert pair_sign("07", "7") == -pair_sign("7", "07")


def test_unicode_digit_ids_neither_crash_pair_sign_nor_the_graph():
    """'²'.isdigit() is True but int('²') raises: ids must be ordered, not crash, whatever their characters."""
    for a, b in [("²", "a"), ("³", "1"), ("¹", "²")]:
        assert pair_sign(a, b) == -pair_sign(b, a)
    graph = neighbours(["²", "1", "a", "³"], num_shares=0, seed="s")
    assert graph["²"] and all(len(n) == 3 for n in graph.values())


# ---- graph ----

def ref_degree(m: int, num_shares: int) -> int:
    """num_shares counts the member itself; 0 = all; odd k with odd m has no k-regular graph: k + 1."""
    if num_shares == 0 or num_shares >= m:
        return m - 1
    k = num_shares - 1
    return min(k + 1 if k % 2 and m % 2 else k, m - 1)


def members_of(m: int) -> list[str]:
    names = [str(i * 3 + 1) for i in range(m - m // 3)] + [f"node-{i}" for i in range(m // 3)]
    return list(np.random.default_rng(m).permutation(names))


@pytest.mark.parametrize("m", range(2, 13))
def test_degree_follows_the_harary_rule(m):
    for s in [0, *range(3, m + 2)]:
        assert degree_for(m, s) == ref_degree(m, s), (m, s)
    assert degree_for(7, 4) == 4 and degree_for(8, 4) == 3 and degree_for(9, 6) == 6 and degree_for(9, 5) == 4


@pytest.mark.parametrize("m", range(2, 13))
def test_graph_is_regular_symmetric_loop_free_and_deterministic(m):
    members = members_of(m)
    for s in range(m + 2):
        graph = neighbours(members, num_shares=s, seed="epoch-7")
        assert set(graph) == set(members)
        for c, ns in graph.items():
            assert len(ns) == len(set(ns)) == degree_for(m, s), (m, s, c)
            assert c not in ns
            assert all(c in graph[n] for n in ns)
        assert graph == neighbours(list(reversed(members)), num_shares=s, seed="epoch-7")  # any member order
        assert graph == neighbours(members, num_shares=s, seed="epoch-7")


@pytest.mark.parametrize("m", range(2, 13))
def test_graph_survives_any_k_minus_1_dropouts(m):
    """k-connected: removing any k - 1 members leaves the rest connected (so pair masks cannot split the sum)."""
    members = members_of(m)
    for s in range(m + 2):
        try:
            graph = neighbours(members, num_shares=s, seed="epoch-7")
        except ValueError:
            assert s in (1, 2), f"only a share count below 3 may be refused, not {s}"
            continue
        k = len(graph[members[0]])
        if k >= m - 1:
            assert all(len(n) == m - 1 for n in graph.values()), "k >= m - 1 is the complete graph"
            continue
        for gone in range(k):
            for dropped in itertools.combinations(members, gone):
                assert connected(set(members) - set(dropped), graph), (m, s, k, dropped)


def test_graph_seed_changes_the_ring_and_refuses_duplicates():
    members = [str(i) for i in range(10)]
    graphs = {tuple(sorted(neighbours(members, num_shares=3, seed=f"e{i}").items())) for i in range(8)}
    assert len(graphs) > 1
    with pytest.raises(ValueError, match="distinct"):
        neighbours(["1", "2", "1"], num_shares=0, seed="s")
    with pytest.raises(ValueError):
        degree_for(0, 3)
    assert neighbours(["solo"], num_shares=0, seed="s") == {"solo": ()}


# ---- shares ----

@FEW
@given(secret=st.binary(min_size=1, max_size=70), holders=st.integers(2, 8), data=st.data())
def test_any_threshold_shares_rebuild_and_fewer_do_not(secret, holders, data):
    threshold = data.draw(st.integers(2, holders), label="threshold")
    shares = split(secret, threshold=threshold, holders=holders)
    assert len(shares) == holders and len(set(shares)) == holders
    subset = data.draw(st.permutations(shares), label="order")[:threshold]
    assert combine(subset) == secret
    assert combine(shares) == secret
    fewer = subset[:threshold - 1]
    try:
        assert combine(fewer) != secret
    except ShareError:
        pass


@pytest.mark.parametrize(("threshold", "holders", "pem"), [(2, 3, True), (3, 5, True), (4, 7, False), (1, 4, False)])
def test_every_subset_of_threshold_size_rebuilds_a_key(threshold, holders, pem):
    """A private key PEM (what is rebuilt for a dropped cluster) or a 32-byte seed, from every subset."""
    secret = KeyPair.generate().private_pem if pem else bytes(range(7, 39))
    shares = split(secret, threshold=threshold, holders=holders)
    for subset in itertools.combinations(shares, threshold):
        assert combine(list(subset)) == secret
    if threshold > 1:
        for subset in itertools.combinations(shares, threshold - 1):
            try:
                assert combine(list(subset)) != secret
            except ShareError:
                pass


def test_split_and_combine_refuse_bad_input():
    for threshold, holders in [(0, 3), (4, 3), (-1, 2)]:
        with pytest.raises(ValueError, match="threshold"):
            split(b"x" * 32, threshold=threshold, holders=holders)
    shares = split(b"x" * 32, threshold=2, holders=3)
    for bad in ([], [shares[0], shares[0]]):
        with pytest.raises(ShareError):
            combine(bad)


@pytest.fixture(scope="module")
def sealing():
    a, b, c = KeyPair.generate(), KeyPair.generate(), KeyPair.generate()
    return fernet_key(a.private_pem, b.public), fernet_key(b.private_pem, a.public), fernet_key(a.private_pem, c.public)


HEADER = {"from": "3", "to": "8", "epoch": "e1", "round": 4, "kind": "s-key"}
json_scalars = st.one_of(st.integers(-2**53, 2**53), st.text(max_size=10), st.booleans(), st.none())


@FEW
@given(share=st.binary(max_size=300), header=st.dictionaries(st.text(max_size=8), json_scalars, max_size=5))
def test_seal_unseal_round_trip(sealing, share, header):
    ab, ba, _ = sealing
    token = seal(ab, header=header, share=share)
    assert unseal(ba, token, expect=header) == share


def test_every_flipped_byte_is_rejected(sealing):
    ab, ba, _ = sealing
    token = seal(ab, header=HEADER, share=b"\x07" * 48)
    for i in range(len(token)):
        for flip in (0x01, 0x20, 0x80):
            bad = bytearray(token)
            bad[i] ^= flip
            with pytest.raises(ShareError):
                unseal(ba, bytes(bad), expect=HEADER)


def test_tampering_inside_the_decoded_token_is_rejected(sealing):
    ab, ba, _ = sealing
    raw = bytearray(base64.urlsafe_b64decode(seal(ab, header=HEADER, share=b"\x07" * 48)))
    for i in range(len(raw)):
        bad = bytearray(raw)
        bad[i] ^= 0x04
        with pytest.raises(ShareError):
            unseal(ba, base64.urlsafe_b64encode(bytes(bad)), expect=HEADER)


def test_another_pairs_key_is_rejected(sealing):
    ab, _, ac = sealing
    token = seal(ab, header=HEADER, share=b"secret share")
    with pytest.raises(ShareError, match="does not authenticate"):
        unseal(ac, token, expect=HEADER)
    with pytest.raises(ShareError):
        unseal(b"not a fernet key", token, expect=HEADER)
    for junk in (b"", b"garbage", token[:40]):
        with pytest.raises(ShareError):
            unseal(ab, junk, expect=HEADER)


@pytest.mark.parametrize("change", [{"round": 5}, {"from": "8", "to": "3"}, {"epoch": "e2"}, {"kind": "b-seed"},
                                    {"extra": 1}])
def test_a_header_mismatch_is_rejected(sealing, change):
    ab, ba, _ = sealing
    token = seal(ab, header=HEADER, share=b"share")
    with pytest.raises(ShareError, match="is for"):
        unseal(ba, token, expect={**HEADER, **change})
    assert unseal(ba, token, expect=json.loads(json.dumps(HEADER))) == b"share"


def test_check_public_accepts_a_peer_key_and_rejects_garbage():
    pk = KeyPair.generate().public
    assert check_public(pk) == pk and check_public(bytearray(pk)) == pk
    der = serialization.load_pem_public_key(pk).public_bytes(serialization.Encoding.DER,
                                                            serialization.PublicFormat.SubjectPublicKeyInfo)
    for junk in (b"", b"garbage", b"\x00" * 120, pk[:60], pk.replace(b"A", b"B", 3), der,
                 b"-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n", KeyPair.generate().private_pem):
        with pytest.raises(ShareError):
            check_public(junk)


def _public_pem(key) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


@pytest.mark.parametrize("kind", ["rsa", "ed25519", "p256"])
def test_check_public_rejects_keys_that_cannot_agree(kind):
    """A well-formed PEM of another key type or curve is not a peer key: it must fail here with ShareError,
    not later in pair_secret with a TypeError/ValueError that a stage does not expect."""
    key = {"rsa": lambda: rsa.generate_private_key(public_exponent=65537, key_size=1024),
           "ed25519": ed25519.Ed25519PrivateKey.generate,
           "p256": lambda: ec.generate_private_key(ec.SECP256R1())}[kind]()
    with pytest.raises(ShareError):
        check_public(_public_pem(key))
