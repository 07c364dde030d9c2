import math

import pytest

from nebula_fl.errors import NebulaError
from nebula_fl.wan import LinkProfile, parse_profile, parse_profiles


@pytest.mark.parametrize(
    ("text", "down", "up", "rtt", "jitter"),
    [
        ("20mbit:100ms", 20e6, 20e6, 0.1, 0.0),
        ("100mbit/20mbit:50ms", 100e6, 20e6, 0.05, 0.0),
        ("1gbit:2ms:1ms", 1e9, 1e9, 0.002, 0.001),
        ("2.5mbit:0.1s", 2.5e6, 2.5e6, 0.1, 0.0),
        ("500kbit:0", 500e3, 500e3, 0.0, 0.0),
        (" 10MBIT / 512Kbit : 1s : 5ms ", 10e6, 512e3, 1.0, 0.005),
        (".5gbit:.5ms", 0.5e9, 0.5e9, 0.0005, 0.0),
    ],
)
def test_good_profiles_parse_and_round_trip_through_their_spec(text, down, up, rtt, jitter):
    p = parse_profile(text)
    assert (p.down_bps, p.up_bps) == (pytest.approx(down), pytest.approx(up))
    assert (p.rtt_s, p.jitter_s) == (pytest.approx(rtt), pytest.approx(jitter))
    assert p.one_way_s == pytest.approx(rtt / 2)
    again = parse_profile(p.spec)
    for name in ("down_bps", "up_bps", "rtt_s", "jitter_s"):
        assert math.isclose(getattr(again, name), getattr(p, name), rel_tol=1e-9, abs_tol=1e-15)
    assert LinkProfile.from_json(p.to_json()) == p
    assert p.to_json()["spec"] == p.spec == str(p)


def test_spec_is_canonical():
    assert parse_profile("20000kbit:0.1s").spec == "20mbit:100ms"
    assert parse_profile("100mbit/20mbit:50ms").spec == "100mbit/20mbit:50ms"
    assert parse_profile("1gbit:2ms:1ms").spec == "1gbit:2ms:1ms"
    assert parse_profile("20mbit/20mbit:2s").spec == "20mbit:2s"


@pytest.mark.parametrize(
    ("text", "hint"),
    [
        ("", "empty"),
        ("20mbit", "RATE:RTT"),
        ("20mbit:100ms:1ms:2ms", "4 ':'-separated"),
        ("20:100ms", "kbit, mbit, gbit"),
        ("20mbps:100ms", "kbit, mbit, gbit"),
        ("20mbit:100", "ms, s"),
        ("20mbit:100us", "ms, s"),
        ("x:y", "needs a number"),
        ("-1mbit:10ms", "needs a number"),
        ("0mbit:10ms", "must be positive"),
        ("20mbit/:10ms", "needs a number"),
        ("1mbit/2mbit/3mbit:1ms", "more than one '/'"),
        ("20mbit:100ms:abc", "needs a number"),
    ],
)
def test_bad_profiles_say_how_to_fix(text, hint):
    with pytest.raises(ValueError, match="WAN profile") as info:
        parse_profile(text)
    assert hint in str(info.value)
    assert isinstance(info.value, NebulaError)  # the CLI prints it as one line and exits 2
    assert "\n" not in str(info.value)


def test_link_profile_validates_its_fields():
    with pytest.raises(ValueError, match="positive"):
        LinkProfile(down_bps=0, up_bps=1e6, rtt_s=0.1)
    with pytest.raises(ValueError, match="0 or more"):
        LinkProfile(down_bps=1e6, up_bps=1e6, rtt_s=-0.1)
    with pytest.raises(ValueError, match="finite"):
        LinkProfile(down_bps=math.inf, up_bps=1e6, rtt_s=0.1)
    with pytest.raises(ValueError, match="finite"):
        LinkProfile(down_bps=1e6, up_bps=1e6, rtt_s=0.1, jitter_s=True)
    with pytest.raises(ValueError, match="down_bps, up_bps and rtt_s"):
        LinkProfile.from_json({"up_bps": 1})
    p = LinkProfile(down_bps=1_000_000, up_bps=2e6, rtt_s=0)
    assert isinstance(p.down_bps, float) and isinstance(p.rtt_s, float)


def test_transfer_seconds_is_serialization_only():
    p = parse_profile("100mbit/20mbit:50ms")
    assert p.transfer_seconds(2_500_000, "up") == pytest.approx(1.0)
    assert p.transfer_seconds(2_500_000, "down") == pytest.approx(0.2)
    assert p.transfer_seconds(0, "up") == 0.0
    with pytest.raises(ValueError, match="'up'"):
        p.transfer_seconds(1, "sideways")
    with pytest.raises(ValueError, match="0 or more"):
        p.transfer_seconds(-1, "up")


def test_parse_profiles_one_for_all_or_one_each():
    assert parse_profiles("20mbit:100ms", 3) == [parse_profile("20mbit:100ms")] * 3
    each = parse_profiles("20mbit:100ms, 1gbit:2ms", 2)
    assert [p.spec for p in each] == ["20mbit:100ms", "1gbit:2ms"]
    with pytest.raises(ValueError, match="2 profiles for 3 clusters"):
        parse_profiles("20mbit:100ms,1gbit:2ms", 3)
    with pytest.raises(ValueError, match="stray comma"):
        parse_profiles("20mbit:100ms,", 2)
    with pytest.raises(ValueError, match="empty"):
        parse_profiles("  ", 2)
    with pytest.raises(ValueError, match="clusters >= 1"):
        parse_profiles("20mbit:100ms", 0)
    with pytest.raises(ValueError, match="'bad'"):
        parse_profiles("20mbit:100ms,bad", 2)
