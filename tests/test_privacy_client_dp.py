"""Client-level DP maths: global-norm clipping, noise shares whose sum has std σC, the server's accountant."""

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from nebula_fl.privacy.client_dp import (
    ServerDPAccountant,
    add_gaussian,
    clip_update,
    global_norm,
    noise_share_std,
)
from nebula_fl.privacy.ledger import PrivacyLedger

finite = st.floats(-1e3, 1e3, allow_nan=False, width=32)
updates = st.dictionaries(st.sampled_from(["a", "b", "c"]),
                          arrays(np.float32, st.tuples(st.integers(1, 5), st.integers(1, 6)), elements=finite),
                          min_size=1)


@settings(max_examples=60, deadline=None)
@given(update=updates, max_norm=st.floats(1e-3, 1e3))
def test_clipping_never_exceeds_the_bound_and_keeps_direction(update, max_norm):
    clipped, norm = clip_update(update, max_norm=max_norm)
    assert norm == pytest.approx(global_norm(update))
    assert global_norm(clipped) <= max_norm
    assert set(clipped) == set(update) and all(clipped[k].dtype == update[k].dtype for k in update)
    if norm <= max_norm:
        for k in update:
            np.testing.assert_array_equal(clipped[k], update[k])
    else:
        scale = max_norm / norm
        for k in update:
            np.testing.assert_allclose(clipped[k], update[k].astype(np.float64) * scale, rtol=1e-5, atol=1e-6 * max_norm)


def test_small_updates_are_untouched_and_copied():
    update = {"w": np.array([0.3, 0.4], np.float32), "b": np.zeros(3, np.float32)}
    clipped, norm = clip_update(update, max_norm=1.0)
    assert norm == pytest.approx(0.5)
    np.testing.assert_array_equal(clipped["w"], update["w"])
    clipped["w"][0] = 9
    assert update["w"][0] == np.float32(0.3)
    big, norm = clip_update({"w": np.array([3.0, 4.0], np.float32)}, max_norm=1.0)
    assert norm == pytest.approx(5.0) and np.allclose(big["w"], [0.6, 0.8])


def test_clipping_refuses_non_finite_or_non_float_updates():
    with pytest.raises(ValueError, match="non-finite values in w"):
        clip_update({"w": np.array([1.0, np.nan], np.float32)}, max_norm=1.0)
    with pytest.raises(ValueError, match="float tensors only"):
        clip_update({"w": np.array([1, 2])}, max_norm=1.0)
    with pytest.raises(ValueError, match="max_norm"):
        clip_update({"w": np.ones(2, np.float32)}, max_norm=0.0)


def test_noise_shares_sum_to_std_sigma_c():
    sigma, c, shares, size = 1.1, 0.5, 5, 200_000
    share = noise_share_std(noise_multiplier=sigma, max_norm=c, shares=shares)
    assert share == pytest.approx(sigma * c / math.sqrt(shares))
    zeros = {"a": np.zeros(size // 2, np.float32), "b": np.zeros((size // 200, 100), np.float32)}
    rng = np.random.default_rng(1234)
    noises = [add_gaussian(zeros, std=share, rng=rng) for _ in range(shares)]
    for noise in noises:
        assert all(v.dtype == np.float32 and np.isfinite(v).all() for v in noise.values())
    total = np.concatenate([sum(n[k].astype(np.float64) for n in noises).ravel() for k in zeros])
    target = sigma * c
    # sample variance of N normals: relative std sqrt(2 / N); allow 5 of them. mean: std target / sqrt(N)
    assert abs(total.var() / target**2 - 1) < 5 * math.sqrt(2 / size)
    assert abs(total.mean()) < 5 * target / math.sqrt(size)


def test_add_gaussian_is_float32_seeded_and_exact_at_zero_std():
    update = {"w": np.arange(6, dtype=np.float64).reshape(2, 3)}
    one = add_gaussian(update, std=0.1, rng=np.random.default_rng(7))
    two = add_gaussian(update, std=0.1, rng=np.random.default_rng(7))
    assert one["w"].dtype == np.float32 and np.isfinite(one["w"]).all()
    np.testing.assert_array_equal(one["w"], two["w"])
    assert not np.array_equal(one["w"], update["w"])
    np.testing.assert_array_equal(add_gaussian(update, std=0.0, rng=np.random.default_rng(0))["w"],
                                  update["w"].astype(np.float32))
    with pytest.raises(ValueError, match="Generator"):
        add_gaussian(update, std=0.1, rng=np.random.RandomState(0))
    with pytest.raises(ValueError, match="shares"):
        noise_share_std(noise_multiplier=1.0, max_norm=1.0, shares=0)


def test_server_accountant_counts_rounds_like_a_ledger_and_resumes():
    server = ServerDPAccountant(accountant="rdp", delta=1e-5)
    for _ in range(10):
        server.record_round(noise_multiplier=1.0, sample_rate=0.5)
    reference = PrivacyLedger(accountant="rdp", delta=1e-5)
    reference.record(noise_multiplier=1.0, sample_rate=0.5, steps=10)
    assert server.rounds == 10 and server.epsilon() == reference.epsilon()
    entry = server.metrics_entry()
    assert entry == {"mode": "client", "epsilon": server.epsilon(), "delta": 1e-5, "noise_multiplier": 1.0,
                     "sample_rate": 0.5, "rounds": 10, "accountant": "rdp"}
    restored = ServerDPAccountant.from_state(json.loads(json.dumps(server.state_dict())))
    assert isinstance(restored, ServerDPAccountant) and restored.epsilon() == server.epsilon()
    restored.record_round(noise_multiplier=1.0, sample_rate=0.5)
    assert restored.epsilon() == server.epsilon_after(noise_multiplier=1.0, sample_rate=0.5, steps=1)


def test_server_accountant_with_prv_and_every_cluster_every_round():
    server = ServerDPAccountant(accountant="prv", delta=1e-5)
    for _ in range(5):
        server.record_round(noise_multiplier=2.0, sample_rate=1.0)
    rdp = ServerDPAccountant(accountant="rdp", delta=1e-5)
    for _ in range(5):
        rdp.record_round(noise_multiplier=2.0, sample_rate=1.0)
    assert 0 < server.epsilon() < rdp.epsilon()
