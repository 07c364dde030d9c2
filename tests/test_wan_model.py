import pytest

from nebula_fl.wan import estimate_round, parse_profile, round_seconds, round_trips, wan_seconds


def test_round_trips_come_in_waves_of_max_in_flight():
    assert [round_trips(n) for n in range(6)] == [0, 1, 1, 2, 2, 3]
    assert round_trips(5, max_in_flight=1) == 5
    assert round_trips(5, max_in_flight=8) == 1
    with pytest.raises(ValueError, match="max_in_flight"):
        round_trips(3, max_in_flight=0)
    with pytest.raises(ValueError, match="requests"):
        round_trips(-1)


def test_wan_and_round_seconds_add_serialization_latency_and_compute():
    p = parse_profile("20mbit:100ms")
    args = dict(profile=p, bytes_up=2_500_000, bytes_down=1_250_000, requests_up=3, requests_down=4)
    # 2.5 MB x 8 / 20 Mbit/s = 1.0 s up, 0.5 s down; ceil(3/2) + ceil(4/2) = 4 round trips x 0.1 s
    assert wan_seconds(**args) == pytest.approx(1.0 + 0.5 + 0.4)
    assert round_seconds(**args, compute_s=10.0) == pytest.approx(11.9)
    parts = estimate_round(**args, compute_s=10.0)
    assert (parts.serialization_up_s, parts.serialization_down_s, parts.latency_s) == pytest.approx((1.0, 0.5, 0.4))
    assert parts.to_json()["total_s"] == pytest.approx(11.9)
    assert wan_seconds(**args, max_in_flight=1) == pytest.approx(1.5 + 7 * 0.1)


def test_asymmetric_rates_and_jitter():
    p = parse_profile("100mbit/10mbit:50ms:10ms")
    t = estimate_round(profile=p, bytes_up=1_250_000, bytes_down=1_250_000, requests_up=2, requests_down=1)
    assert t.serialization_up_s == pytest.approx(1.0)
    assert t.serialization_down_s == pytest.approx(0.1)
    assert t.latency_s == pytest.approx(2 * (0.05 + 0.01))  # mean round trip: rtt + 2 x jitter / 2


def test_nothing_to_send_costs_only_compute():
    p = parse_profile("1mbit:1s")
    assert wan_seconds(profile=p, bytes_up=0, bytes_down=0, requests_up=0, requests_down=0) == 0.0
    assert round_seconds(profile=p, bytes_up=0, bytes_down=0, requests_up=0, requests_down=0, compute_s=3) == 3.0


@pytest.mark.parametrize(
    ("field", "value"),
    [("bytes_up", -1), ("bytes_down", float("nan")), ("requests_up", 1.5), ("requests_down", True), ("compute_s", -2)],
)
def test_bad_inputs_are_value_errors(field, value):
    args = dict(profile=parse_profile("20mbit:100ms"), bytes_up=1, bytes_down=1, requests_up=1, requests_down=1,
                compute_s=0.0)
    args[field] = value
    with pytest.raises(ValueError, match="0 or more"):
        round_seconds(**args)


def test_profile_must_be_a_link_profile():
    with pytest.raises(ValueError, match="LinkProfile"):
        wan_seconds(profile="20mbit:100ms", bytes_up=1, bytes_down=1, requests_up=1, requests_down=1)
