import numpy as np
import pytest

from nebula_fl.strategies.aggregation import weighted_mean


def test_weighted_mean_matches_hand_computation():
    a = {"w": np.array([1.0, 2.0, 3.0, 4.0], dtype=np.float32)}
    b = {"w": np.array([5.0, 6.0, 7.0, 8.0], dtype=np.float32)}
    c = {"w": np.array([0.0, 0.0, 0.0, -4.0], dtype=np.float32)}
    # weights 1, 3, 4 -> (1*a + 3*b + 4*c) / 8
    expected = np.array([(1 + 15 + 0) / 8, (2 + 18 + 0) / 8, (3 + 21 + 0) / 8, (4 + 24 - 16) / 8])
    out = weighted_mean([a, b, c], [1, 3, 4])
    np.testing.assert_allclose(out["w"], expected, rtol=1e-7)
    assert out["w"].dtype == np.float32


def test_equal_weights_give_the_plain_mean():
    ups = [{"k": np.array([1.0, -1.0, 2.0, 0.5])}, {"k": np.array([3.0, 1.0, 0.0, 0.5])}]
    np.testing.assert_allclose(weighted_mean(ups, [10, 10])["k"], [2.0, 0.0, 1.0, 0.5])


@pytest.mark.parametrize(
    ("updates", "weights", "match"),
    [
        ([], [], "zero updates"),
        ([{"k": np.zeros(4)}], [1, 2], "1 updates but 2 weights"),
        ([{"k": np.zeros(4)}], [0], "positive sum"),
        ([{"k": np.zeros(4)}, {"j": np.zeros(4)}], [1, 1], "disagree on their keys"),
    ],
)
def test_bad_inputs_raise(updates, weights, match):
    with pytest.raises(ValueError, match=match):
        weighted_mean(updates, weights)
