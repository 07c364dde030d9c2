"""A short, deterministic pass of tests/fuzz_wire.py over every decoder and validator of untrusted input:
each rejects bad input with its documented error only (no crash), and accepts nothing that breaks its promise."""

from __future__ import annotations

import pytest

from tests import fuzz_wire as fuzz

EXAMPLES = {"codec-blob": 300, "config-flat": 200, "config-text": 200, "trainer-frame": 200, "checkpoint": 80,
            "uplink-arrays": 120, "layout-json": 200, "privacy-request": 150, "secagg-stage": 300, "secagg-replies": 150}


def test_every_target_is_covered(tmp_path):
    assert set(EXAMPLES) == set(fuzz.make_targets(tmp_path))


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_no_crash_and_no_violation(tmp_path, name):
    target = fuzz.make_targets(tmp_path)[name]
    tally = fuzz.run_target(target, examples=EXAMPLES[name], seed_value=0)
    assert tally.inputs >= EXAMPLES[name] // 2, tally.inputs  # Hypothesis ran (it may dedupe a few)
    assert tally.rejected > 0, "the generator never produced bad input"
    assert tally.crashes == 0 and tally.violations == 0, tally.summary()


def test_valid_codec_blobs_of_every_chain_decode():
    assert len(fuzz.codec_chains()) >= 20  # 4 transforms x 6 quantizers, alone and chained
    for chain, blobs in fuzz.valid_blobs().items():
        for blob in blobs:
            case = fuzz.Case(chain, {"blob": blob, "seed": fuzz.ROUND_SEED, "_layout": fuzz.LAYOUT})
            assert fuzz.check_decoded(case, fuzz.decode_blob(case)) is None, chain


def test_the_tally_counts_a_crash():
    """The harness itself: an exception other than the documented one is a crash, and is kept for the report."""
    def explode(case):
        raise KeyError(case.args["x"])

    target = fuzz.Target("boom", "explode(x)", (ValueError,), fuzz.st.integers(0, 9).map(
        lambda x: fuzz.Case("int", {"x": x})), explode, lambda case, result: None, 10)
    tally = fuzz.run_target(target, examples=10)
    assert tally.crashes == tally.inputs > 0 and tally.first and "KeyError" in tally.first[0]["error"]
