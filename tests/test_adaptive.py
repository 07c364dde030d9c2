"""Adaptive compression driven by fake bandwidth figures: the choices follow the link."""

import pytest

from nebula_fl.comm.adaptive import BandwidthTracker, candidates, choose, fit_link, knob_of, upload_seconds_estimate


def topk_size(ratio: float, n: int = 75_653) -> int:
    """Bytes of a top-k + int8 blob: 5 bytes per kept entry plus a small header (as the real codec)."""
    return 200 + int(n * ratio) * 5


@pytest.mark.parametrize(("spec", "knob"), [("topk:0.05+int8", "ratio"), ("randk:0.1", "ratio"),
                                            ("lowrank:4+fp16", "rank"), ("int8", "bits"), ("fp16", None)])
def test_knob_of_each_chain(spec, knob):
    assert knob_of(spec) == knob


def test_candidates_cover_the_configured_range():
    ratios = candidates("topk:0.05", low=0.001, high=0.25)
    assert ratios[0] == pytest.approx(0.001) and ratios[-1] == pytest.approx(0.25)
    assert ratios == sorted(ratios)
    assert candidates("lowrank:4", low=1, high=6) == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert candidates("int8", low=1, high=8) == [4.0, 8.0]
    assert candidates("fp16", low=0.001, high=1) == []


def test_the_choice_fits_the_budget_and_is_the_largest_that_does():
    options = candidates("topk:0.05+int8", low=0.001, high=0.25)
    choice = choose(sizes=topk_size, options=options, up_bps=0.5e6, target_s=0.5)
    assert choice.fits and choice.seconds <= 0.5 and choice.seconds == topk_size(choice.param) * 8 / 0.5e6
    bigger = [o for o in options if o > choice.param]
    assert bigger and all(topk_size(o) * 8 / 0.5e6 > 0.5 for o in bigger)


def test_a_faster_link_gets_a_larger_ratio_and_a_slower_one_a_smaller():
    options = candidates("topk:0.05+int8", low=0.001, high=0.25)
    picks = [choose(sizes=topk_size, options=options, up_bps=bps, target_s=0.5).param
             for bps in (0.1e6, 0.5e6, 2e6, 1e9)]
    assert picks == sorted(picks)
    assert picks[0] < picks[1] < picks[2]
    assert picks[-1] == pytest.approx(0.25)  # the cap applies on a fast link


def test_nothing_fits_takes_the_smallest_and_says_so():
    options = candidates("topk:0.05+int8", low=0.01, high=0.25)
    choice = choose(sizes=topk_size, options=options, up_bps=1e4, target_s=0.2)
    assert not choice.fits and choice.param == pytest.approx(0.01)


def test_upload_time_from_wall_clocks_or_the_conservative_fallback():
    exact = upload_seconds_estimate(elapsed_s=10.0, client_s=6.0, bytes_up=100, bytes_down=100,
                                    sent_at=1000.0, arrived_at=1000.4)
    assert exact == pytest.approx(0.4)
    # clocks that disagree (arrival before sending) fall back to the share of the non-compute time
    fallback = upload_seconds_estimate(elapsed_s=10.0, client_s=6.0, bytes_up=300, bytes_down=100,
                                       sent_at=1000.0, arrived_at=999.0)
    assert fallback == pytest.approx(3.0)


def test_fitting_separates_latency_from_bandwidth():
    # uploads of 1.2 s fixed latency plus 8 Mbit/s: three sizes recover both
    obs = [(b, 1.2 + b * 8 / 8e6) for b in (10_000, 100_000, 400_000)]
    fixed, per_byte = fit_link(obs)
    assert fixed == pytest.approx(1.2) and 8 / per_byte == pytest.approx(8e6)
    assert fit_link(obs[:1]) is None  # one size cannot tell the two apart
    assert fit_link([(1000, 1.0), (1100, 1.1)]) is None  # nor can two sizes too close


def test_tracker_prefers_configured_links_and_fits_measurements():
    tracker = BandwidthTracker(configured={"1": 5e6})
    assert tracker.get("0") is None
    tracker.observe("0", bytes_up=10_000, seconds=1.21)
    assert tracker.get("0") is None and tracker.seen("0") == 1
    tracker.observe("0", bytes_up=1_000_000, seconds=2.2)  # 1 s more for 990 kB more: 8 Mbit/s, well resolved
    assert tracker.get("0") == pytest.approx(8e6, rel=0.01)
    tracker.observe("1", bytes_up=1, seconds=1.0)
    assert tracker.get("1") == 5e6
    restored = BandwidthTracker()
    restored.load_state_dict(tracker.state_dict())
    assert restored.get("0") == pytest.approx(8e6, rel=0.01)
    # bytes that cost nothing measurable (a fast link under timing noise) read as an unlimited link:
    # a faster upload of more bytes, or a slower one by less than the timing noise
    fast = BandwidthTracker()
    fast.observe("0", bytes_up=2_000, seconds=1.3)
    fast.observe("0", bytes_up=90_000, seconds=1.25)
    assert fast.get("0") == float("inf")
    noisy = BandwidthTracker()
    noisy.observe("0", bytes_up=6_000, seconds=1.30)
    noisy.observe("0", bytes_up=20_000, seconds=1.48)  # +0.18 s for 14 kB would be 0.6 Mbit/s, but is noise
    assert noisy.get("0") == float("inf")
    assert BandwidthTracker(configured={"*": 2e6}).get("7") == 2e6
